//! Passive outlier ejection, after Envoy's: a replica that could not be reached or failed a
//! request it took is tried after the healthy ones for a while (Envoy takes it out of the
//! pool; tried last, it still serves a deployment whose every replica failed lately).
//! Without it, a replica that fails every request fast is the least loaded and draws most
//! of the traffic, and a host that is down costs every request the connect timeout until
//! its lease expires.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// How long a first failure sets a replica back; each further one doubles it, up to
/// [`LONGEST`].
const FIRST: Duration = Duration::from_secs(5);
const LONGEST: Duration = Duration::from_secs(60);

struct Mark {
    /// Failures since the replica last answered, counting one per back-off.
    failures: u32,
    /// Until when it is tried after the others.
    until: Instant,
    /// When it last failed: an answer to a request sent before then says nothing of it now.
    latest: Instant,
}

/// The replicas that failed lately, by replica id; a replica leaves on its first success.
#[derive(Default)]
pub(super) struct Ejections {
    marks: HashMap<Uuid, Mark>,
}

impl Ejections {
    /// `replica` failed at `now`. Requests that were in flight together meet one outage, so
    /// a failure while the replica is already set back does not lengthen it; the next
    /// failure after the back-off has passed doubles it.
    pub(super) fn failed(&mut self, replica: Uuid, now: Instant) {
        let mark = self.marks.entry(replica).or_insert(Mark { failures: 0, until: now, latest: now });
        mark.latest = mark.latest.max(now);
        if mark.until > now {
            return;
        }
        mark.failures = mark.failures.saturating_add(1);
        mark.until = now + back_off(mark.failures);
    }

    /// `replica` answered a request sent at `sent`: it is healthy again, and a later failure
    /// starts from [`FIRST`]. A slow answer to a request sent before its latest failure
    /// (one that was queued before it broke) leaves the mark as it is.
    pub(super) fn succeeded(&mut self, replica: Uuid, sent: Instant) {
        if self.marks.get(&replica).is_some_and(|mark| mark.latest <= sent) {
            self.marks.remove(&replica);
        }
    }

    /// Whether `replica` is set back at `now`, to be tried after the others.
    pub(super) fn ejected(&self, replica: Uuid, now: Instant) -> bool {
        self.marks.get(&replica).is_some_and(|mark| mark.until > now)
    }

    /// Forgets at `now` the marks of replicas that no route leads to (`routed` says which
    /// one does): they stopped or moved, and one that comes back starts with a clean
    /// record. A mark outlives its back-off by [`LONGEST`] first, as a replica that just
    /// failed is missing while its deployment's route, dropped to be read again, is not
    /// cached. So the map holds the routed replicas and those that failed in the last
    /// minutes, no more.
    pub(super) fn retain(&mut self, routed: impl Fn(Uuid) -> bool, now: Instant) {
        if !self.marks.is_empty() {
            self.marks.retain(|&replica, mark| mark.until + LONGEST > now || routed(replica));
        }
    }
}

/// [`FIRST`] doubled for each failure after the first, at most [`LONGEST`].
fn back_off(failures: u32) -> Duration {
    // Past five doublings the cap holds anyway; stopping there keeps the power in range.
    let doublings = failures.saturating_sub(1).min(5);
    (FIRST * 2u32.pow(doublings)).min(LONGEST)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_from_five_seconds_to_a_minute() {
        let seconds: Vec<u64> = (1..=7).map(|failures| back_off(failures).as_secs()).collect();
        assert_eq!(seconds, [5, 10, 20, 40, 60, 60, 60]);
        assert_eq!(back_off(u32::MAX), LONGEST);
    }

    #[test]
    fn a_failing_replica_is_set_back_until_its_back_off_passes_or_it_answers() {
        let (replica, other) = (Uuid::new_v4(), Uuid::new_v4());
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut ejections = Ejections::default();
        ejections.failed(replica, at(0));
        // Failures of requests in flight with the first do not lengthen it.
        ejections.failed(replica, at(1));
        assert!(ejections.ejected(replica, at(4)) && !ejections.ejected(other, at(4)));
        assert!(!ejections.ejected(replica, at(5)), "five seconds for a first failure");
        // Failing again once it is tried: twice as long.
        ejections.failed(replica, at(6));
        assert!(ejections.ejected(replica, at(15)) && !ejections.ejected(replica, at(16)));
        // An answer to a request sent before the latest failure does not end it.
        ejections.succeeded(replica, at(5));
        assert!(ejections.ejected(replica, at(15)));
        // An answer to one sent since does, and the next failure counts from the start.
        ejections.succeeded(replica, at(6));
        assert!(!ejections.ejected(replica, at(16)));
        ejections.failed(replica, at(20));
        assert!(!ejections.ejected(replica, at(25)));
    }

    #[test]
    fn marks_of_replicas_no_route_leads_to_are_forgotten_a_minute_after_their_back_off() {
        let (routed, gone) = (Uuid::new_v4(), Uuid::new_v4());
        let start = Instant::now();
        let mut ejections = Ejections::default();
        ejections.failed(routed, start);
        ejections.failed(gone, start);
        // Just failed, `gone` may only be missing while its route is read again.
        ejections.retain(|replica| replica == routed, start);
        assert!(ejections.ejected(gone, start));
        ejections.retain(|replica| replica == routed, start + FIRST + LONGEST);
        assert_eq!(ejections.marks.keys().collect::<Vec<_>>(), [&routed]);
    }
}
