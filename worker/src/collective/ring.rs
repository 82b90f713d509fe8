//! A host-staged ring all-reduce over TCP between the ranks of a data-parallel gang
//! (Patarasuk & Yuan's bandwidth-optimal ring, as NCCL and Horovod run it): rank r reads
//! from rank r-1 and writes to rank r+1. Each bucket is cut into `world` chunks, reduced
//! by a reduce-scatter (W-1 steps, each adding the received partial sum to its own
//! chunk) and spread by an all-gather (W-1 steps of copies). The order of the f32 sums is
//! fixed: chunk c adds ranks c, c+1, …, c-1 left to right, and every rank receives the
//! owner's bytes, so all ranks hold bit-identical results, run after run.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Elements per bucket by default (4 MiB of f32): large enough to keep the link busy,
/// small enough that a model's gradients stream in several pieces.
pub const DEFAULT_BUCKET: usize = 1 << 20;

const MAGIC: &[u8; 8] = b"TSRING01";

#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("rank {peer} is gone or did not answer in time ({source}); the step fails and the gang resumes from its last checkpoint")]
    Peer { peer: usize, source: io::Error },
    #[error("could not connect to rank {peer} at {address}: {source}")]
    Connect { peer: usize, address: String, source: io::Error },
    #[error("no connection from rank {peer} within {seconds} s")]
    NoNeighbour { peer: usize, seconds: u64 },
    #[error("the ranks are out of step: this rank is at {ours}, rank {peer}'s neighbour at {theirs}")]
    OutOfStep { peer: usize, ours: String, theirs: String },
    #[error("cannot listen for the ring: {0}")]
    Listen(io::Error),
}

/// Who a rank is; exchanged when the ring connects, so a connection from another gang,
/// an earlier attempt, or a rank resumed from another checkpoint is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub gang: Uuid,
    pub generation: u32,
    pub world: u32,
    pub rank: u32,
    /// The step the rank starts training from (its checkpoint's).
    pub start_step: u64,
}

impl Hello {
    fn encode(&self) -> [u8; 44] {
        let mut bytes = [0u8; 44];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8..24].copy_from_slice(self.gang.as_bytes());
        bytes[24..28].copy_from_slice(&self.generation.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.world.to_le_bytes());
        bytes[32..36].copy_from_slice(&self.rank.to_le_bytes());
        bytes[36..44].copy_from_slice(&self.start_step.to_le_bytes());
        bytes
    }

    fn decode(bytes: &[u8; 44]) -> Option<Hello> {
        if &bytes[..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
        Some(Hello {
            gang: Uuid::from_slice(&bytes[8..24]).ok()?,
            generation: u32_at(24),
            world: u32_at(28),
            rank: u32_at(32),
            start_step: u64::from_le_bytes(bytes[36..44].try_into().unwrap()),
        })
    }
}

/// How one all-reduce spent its time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    /// Until every rank had entered the all-reduce (waiting for the slowest).
    pub wait: Duration,
    /// The reduction itself: transfers and sums.
    pub reduce: Duration,
}

/// The longest a rank waits on rank 0's [`Ring::broadcast_unhurried`] (an evaluation of
/// the whole validation split).
pub const UNHURRIED: Duration = Duration::from_secs(3600);

/// One rank's two connections of the ring.
pub struct Ring {
    rank: usize,
    world: usize,
    /// From rank - 1 (reads); `None` alone in a world of one.
    left: Option<TcpStream>,
    /// To rank + 1 (writes).
    right: Option<TcpStream>,
    bucket: usize,
    /// All-reduces done, checked against the neighbours' so no rank skips one.
    sequence: u64,
}

fn left_of(rank: usize, world: usize) -> usize {
    (rank + world - 1) % world
}

impl Ring {
    /// A world of one: every reduction is the identity.
    pub fn alone() -> Ring {
        Ring { rank: 0, world: 1, left: None, right: None, bucket: DEFAULT_BUCKET, sequence: 0 }
    }

    /// Joins the ring as `hello.rank` of `peers.len()`: connects to the next rank's address
    /// and accepts the previous rank on `listener` (bound at `peers[rank]`). `timeout`
    /// bounds the set-up and every later read or write: a rank silent that long is dead.
    pub fn connect(
        listener: &TcpListener,
        peers: &[String],
        hello: Hello,
        timeout: Duration,
    ) -> Result<Ring, RingError> {
        let world = peers.len();
        let rank = hello.rank as usize;
        assert!(rank < world && hello.world as usize == world, "rank {rank} of a world of {world}");
        if world == 1 {
            return Ok(Ring::alone());
        }
        let deadline = Instant::now() + timeout;
        let next = (rank + 1) % world;
        let mut right = loop {
            match TcpStream::connect(&peers[next]) {
                Ok(stream) => break stream,
                Err(source) if Instant::now() >= deadline => {
                    return Err(RingError::Connect { peer: next, address: peers[next].clone(), source })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let peer_error = |peer| move |source| RingError::Peer { peer, source };
        right.set_nodelay(true).map_err(peer_error(next))?;
        right.set_write_timeout(Some(timeout)).map_err(peer_error(next))?;
        right.write_all(&hello.encode()).map_err(peer_error(next))?;

        let previous = left_of(rank, world);
        let expected = Hello { rank: previous as u32, ..hello };
        listener.set_nonblocking(true).map_err(RingError::Listen)?;
        let left = loop {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).map_err(RingError::Listen)?;
                    stream.set_read_timeout(Some(timeout)).map_err(peer_error(previous))?;
                    let mut bytes = [0u8; 44];
                    // Anything but the expected neighbour (a stale attempt, a stranger) is dropped.
                    if stream.read_exact(&mut bytes).is_err() {
                        continue;
                    }
                    match Hello::decode(&bytes) {
                        Some(theirs) if theirs == expected => break stream,
                        Some(theirs) if theirs.gang == hello.gang && theirs.generation == hello.generation => {
                            return Err(RingError::OutOfStep {
                                peer: previous,
                                ours: format!("step {}", hello.start_step),
                                theirs: format!("rank {} at step {}", theirs.rank, theirs.start_step),
                            })
                        }
                        _ => continue,
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(RingError::NoNeighbour { peer: previous, seconds: timeout.as_secs() });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(RingError::Listen(e)),
            }
        };
        left.set_nodelay(true).map_err(peer_error(previous))?;
        left.set_write_timeout(Some(timeout)).map_err(peer_error(previous))?;
        Ok(Ring { rank, world, left: Some(left), right: Some(right), bucket: DEFAULT_BUCKET, sequence: 0 })
    }

    /// Elements per bucket (at least 1).
    pub fn with_bucket(mut self, bucket: usize) -> Ring {
        self.bucket = bucket.max(1);
        self
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Handles that break the ring from another thread (a revoked lease): shutting them
    /// down stops a rank blocked in a read at once instead of at the time-out.
    pub fn breakers(&self) -> io::Result<Vec<TcpStream>> {
        self.left.iter().chain(&self.right).map(TcpStream::try_clone).collect()
    }

    fn previous(&self) -> usize {
        left_of(self.rank, self.world)
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// Replaces `data` on every rank by the element-wise sum over the ranks.
    pub fn all_reduce(&mut self, data: &mut [f32]) -> Result<Timing, RingError> {
        if self.world == 1 {
            return Ok(Timing::default());
        }
        let entered = Instant::now();
        self.sequence += 1;
        self.barrier(data.len() as u64)?;
        let wait = entered.elapsed();
        let bucket = self.bucket;
        for part in data.chunks_mut(bucket) {
            self.reduce_bucket(part)?;
        }
        Ok(Timing { wait, reduce: entered.elapsed() - wait })
    }

    /// Passes every rank's (sequence, length) once around the ring: when it returns,
    /// every rank has entered this all-reduce with the same length.
    fn barrier(&mut self, length: u64) -> Result<(), RingError> {
        let mut ours = [0u8; 16];
        ours[..8].copy_from_slice(&self.sequence.to_le_bytes());
        ours[8..].copy_from_slice(&length.to_le_bytes());
        let (previous, next) = (self.previous(), self.next());
        let right = self.right.as_mut().expect("a ring of two or more");
        right.write_all(&ours).map_err(|source| RingError::Peer { peer: next, source })?;
        for hop in 0..self.world - 1 {
            let mut theirs = [0u8; 16];
            let left = self.left.as_mut().expect("a ring of two or more");
            left.read_exact(&mut theirs).map_err(|source| RingError::Peer { peer: previous, source })?;
            if theirs != ours {
                let describe = |b: &[u8; 16]| {
                    format!(
                        "all-reduce {} of {} values",
                        u64::from_le_bytes(b[..8].try_into().unwrap()),
                        u64::from_le_bytes(b[8..].try_into().unwrap())
                    )
                };
                return Err(RingError::OutOfStep { peer: previous, ours: describe(&ours), theirs: describe(&theirs) });
            }
            if hop + 2 < self.world {
                let right = self.right.as_mut().expect("a ring of two or more");
                right.write_all(&theirs).map_err(|source| RingError::Peer { peer: next, source })?;
            }
        }
        Ok(())
    }

    /// Writes `send` to the next rank while reading `receive` from the previous one (both
    /// at once: two ranks writing large chunks to each other would otherwise block on
    /// full socket buffers).
    fn exchange(&mut self, send: &[f32], receive: &mut [f32]) -> Result<(), RingError> {
        let (previous, next) = (self.previous(), self.next());
        let right = self.right.as_mut().expect("a ring of two or more");
        let left = self.left.as_mut().expect("a ring of two or more");
        let outgoing: Vec<u8> = send.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut incoming = vec![0u8; receive.len() * 4];
        let (sent, received) = std::thread::scope(|scope| {
            let writer = scope.spawn(|| right.write_all(&outgoing));
            let received = left.read_exact(&mut incoming);
            (writer.join().unwrap_or_else(|_| Err(io::Error::other("the ring's writer panicked"))), received)
        });
        received.map_err(|source| RingError::Peer { peer: previous, source })?;
        sent.map_err(|source| RingError::Peer { peer: next, source })?;
        for (value, bytes) in receive.iter_mut().zip(incoming.chunks_exact(4)) {
            *value = f32::from_le_bytes(bytes.try_into().unwrap());
        }
        Ok(())
    }

    fn reduce_bucket(&mut self, data: &mut [f32]) -> Result<(), RingError> {
        let (world, rank) = (self.world, self.rank);
        let n = data.len();
        let bounds = |chunk: usize| (chunk * n / world, (chunk + 1) * n / world);
        let mut incoming = Vec::new();
        // Reduce-scatter: after step s, chunk (rank - s - 1) holds ranks (rank - s - 1 ..= rank).
        for step in 0..world - 1 {
            let (send_start, send_end) = bounds((rank + world - step) % world);
            let (recv_start, recv_end) = bounds((rank + 2 * world - step - 1) % world);
            incoming.resize(recv_end - recv_start, 0.0);
            self.exchange(&data[send_start..send_end], &mut incoming)?;
            for (own, partial) in data[recv_start..recv_end].iter_mut().zip(&incoming) {
                *own = partial + *own;
            }
        }
        // All-gather: rank r now owns the full sum of chunk r + 1; pass the sums around.
        for step in 0..world - 1 {
            let (send_start, send_end) = bounds((rank + 1 + world - step) % world);
            let (recv_start, recv_end) = bounds((rank + world - step) % world);
            incoming.resize(recv_end - recv_start, 0.0);
            self.exchange(&data[send_start..send_end], &mut incoming)?;
            data[recv_start..recv_end].copy_from_slice(&incoming);
        }
        Ok(())
    }

    /// Rank 0's `bytes` on every rank (others pass an empty vector), forwarded along the
    /// ring.
    pub fn broadcast(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, RingError> {
        if self.world == 1 {
            return Ok(bytes);
        }
        let (previous, next) = (self.previous(), self.next());
        let bytes = if self.rank == 0 {
            bytes
        } else {
            let left = self.left.as_mut().expect("a ring of two or more");
            let mut length = [0u8; 8];
            left.read_exact(&mut length).map_err(|source| RingError::Peer { peer: previous, source })?;
            let mut received = vec![0u8; u64::from_le_bytes(length) as usize];
            left.read_exact(&mut received).map_err(|source| RingError::Peer { peer: previous, source })?;
            received
        };
        if self.rank + 1 < self.world {
            let right = self.right.as_mut().expect("a ring of two or more");
            right
                .write_all(&(bytes.len() as u64).to_le_bytes())
                .map_err(|source| RingError::Peer { peer: next, source })?;
            right.write_all(&bytes).map_err(|source| RingError::Peer { peer: next, source })?;
        }
        Ok(bytes)
    }
}

impl Ring {
    /// [`broadcast`](Self::broadcast) from a rank 0 that may take long to send (it
    /// evaluates the whole validation split while the others wait): they wait up to
    /// [`UNHURRIED`] instead of the ring's read time-out. A rank 0 that died is noticed
    /// sooner: its lease lapses, the server stops the gang, and the breakers end the wait.
    pub fn broadcast_unhurried(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, RingError> {
        let Some(left) = &self.left else {
            return self.broadcast(bytes);
        };
        let previous = self.previous();
        let peer_error = |source| RingError::Peer { peer: previous, source };
        let patience = left.read_timeout().map_err(peer_error)?;
        left.set_read_timeout(Some(UNHURRIED)).map_err(peer_error)?;
        let received = self.broadcast(bytes);
        let left = self.left.as_ref().expect("still connected");
        left.set_read_timeout(patience).map_err(peer_error)?;
        received
    }

    /// Every rank's `bytes`, indexed by rank, on every rank: each rank's bytes travel the
    /// ring's W − 1 hops (the ranks exchange what they measured before planning).
    pub fn all_gather(&mut self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, RingError> {
        let (world, rank) = (self.world, self.rank);
        let mut gathered = vec![Vec::new(); world];
        gathered[rank] = bytes;
        // Hop h passes on what came from h ranks back, and receives from h + 1 ranks back.
        for hop in 0..world.saturating_sub(1) {
            let send = (rank + world - hop) % world;
            let receive = (rank + 2 * world - hop - 1) % world;
            gathered[receive] = self.exchange_frame(&gathered[send])?;
        }
        Ok(gathered)
    }

    /// Writes one length-prefixed frame to the next rank while reading one from the
    /// previous (both at once, as `exchange` does).
    fn exchange_frame(&mut self, send: &[u8]) -> Result<Vec<u8>, RingError> {
        let (previous, next) = (self.previous(), self.next());
        let right = self.right.as_mut().expect("a ring of two or more");
        let left = self.left.as_mut().expect("a ring of two or more");
        let (sent, received) = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                right.write_all(&(send.len() as u64).to_le_bytes())?;
                right.write_all(send)
            });
            let received = (|| {
                let mut length = [0u8; 8];
                left.read_exact(&mut length)?;
                let mut frame = vec![0u8; u64::from_le_bytes(length) as usize];
                left.read_exact(&mut frame)?;
                Ok(frame)
            })();
            (writer.join().unwrap_or_else(|_| Err(io::Error::other("the ring's writer panicked"))), received)
        });
        sent.map_err(|source| RingError::Peer { peer: next, source })?;
        received.map_err(|source| RingError::Peer { peer: previous, source })
    }
}

/// Rings of `world` ranks over loopback TCP in this process (tests and benchmarks).
pub fn loopback(world: usize, gang: Uuid, timeout: Duration) -> Result<Vec<Ring>, RingError> {
    let listeners: Vec<TcpListener> =
        (0..world).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<io::Result<_>>().map_err(RingError::Listen)?;
    let peers: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<io::Result<_>>()
        .map_err(RingError::Listen)?;
    std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, listener)| {
                let peers = &peers;
                let hello = Hello { gang, generation: 1, world: world as u32, rank: rank as u32, start_step: 0 };
                scope.spawn(move || Ring::connect(listener, peers, hello, timeout))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("ring set-up thread")).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the ring computes, in its order: chunk c sums ranks c, c+1, …, c-1.
    fn reference(inputs: &[Vec<f32>], bucket: usize) -> Vec<f32> {
        let world = inputs.len();
        let n = inputs[0].len();
        let mut out = vec![0.0f32; n];
        for start in (0..n).step_by(bucket) {
            let len = bucket.min(n - start);
            for chunk in 0..world {
                for i in start + chunk * len / world..start + (chunk + 1) * len / world {
                    let mut sum = inputs[chunk][i];
                    for k in 1..world {
                        sum += inputs[(chunk + k) % world][i];
                    }
                    out[i] = sum;
                }
            }
        }
        out
    }

    fn inputs(world: usize, n: usize) -> Vec<Vec<f32>> {
        // Values of mixed magnitude, so a different summation order shows in the low bits.
        (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 * 1e-3 * 10f32.powi((i % 7) as i32 - 3))
                    .collect()
            })
            .collect()
    }

    fn run(world: usize, n: usize, bucket: usize) {
        let rings = loopback(world, Uuid::new_v4(), Duration::from_secs(10)).unwrap();
        let data = inputs(world, n);
        let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .zip(data.clone())
                .map(|(ring, mut values)| {
                    scope.spawn(move || {
                        let mut ring = ring.with_bucket(bucket);
                        ring.all_reduce(&mut values).unwrap();
                        values
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected = reference(&data, bucket);
        for (rank, result) in results.iter().enumerate() {
            let same_bits = result.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same_bits, "rank {rank} of {world}, {n} values in buckets of {bucket}");
        }
        for (i, value) in expected.iter().enumerate() {
            let exact: f64 = data.iter().map(|d| d[i] as f64).sum();
            assert!((*value as f64 - exact).abs() <= 1e-6 * exact.abs().max(1e-6), "value {i}: {value} vs {exact}");
        }
    }

    #[test]
    fn two_three_and_four_ranks_sum_bit_identically_in_odd_buckets() {
        for world in 2..=4 {
            for (n, bucket) in [(1, 1), (2, 7), (17, 5), (1000, 7), (1001, 13), (4096, DEFAULT_BUCKET)] {
                run(world, n, bucket);
            }
        }
    }

    #[test]
    fn rank_zero_broadcasts_to_every_rank() {
        let rings = loopback(3, Uuid::new_v4(), Duration::from_secs(10)).unwrap();
        let results: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|mut ring| {
                    scope.spawn(move || {
                        let payload = if ring.rank() == 0 { b"evaluation".to_vec() } else { Vec::new() };
                        ring.broadcast(payload).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| r == b"evaluation"));
    }

    /// Rank 0 evaluating for longer than the ring's time-out does not fail the others'
    /// unhurried wait, where a plain broadcast gives up; the time-out holds again after.
    #[test]
    fn an_unhurried_broadcast_outwaits_the_ring_s_time_out_and_restores_it() {
        let timeout = Duration::from_millis(200);
        for unhurried in [true, false] {
            let rings = loopback(2, Uuid::new_v4(), timeout).unwrap();
            let results: Vec<Result<Vec<u8>, RingError>> = std::thread::scope(|scope| {
                let handles: Vec<_> = rings
                    .into_iter()
                    .map(|mut ring| {
                        scope.spawn(move || {
                            let payload = if ring.rank() == 0 {
                                std::thread::sleep(3 * timeout);
                                b"evaluation".to_vec()
                            } else {
                                Vec::new()
                            };
                            let received =
                                if unhurried { ring.broadcast_unhurried(payload) } else { ring.broadcast(payload) };
                            if unhurried && ring.rank() == 0 {
                                std::thread::sleep(5 * timeout);
                            }
                            if unhurried && ring.rank() == 1 {
                                // Rank 0 stays connected but silent: the restored time-out ends this read.
                                let started = Instant::now();
                                assert!(ring.broadcast(Vec::new()).is_err());
                                assert!(started.elapsed() < 4 * timeout, "{:?}", started.elapsed());
                            }
                            received
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            if unhurried {
                assert_eq!(results[1].as_ref().unwrap(), b"evaluation");
            } else {
                assert!(matches!(results[1], Err(RingError::Peer { .. })), "{:?}", results[1]);
            }
        }
    }

    #[test]
    fn every_rank_gathers_every_rank_s_bytes_in_rank_order() {
        for world in 2..=4 {
            let rings = loopback(world, Uuid::new_v4(), Duration::from_secs(10)).unwrap();
            let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|scope| {
                let handles: Vec<_> = rings
                    .into_iter()
                    .map(|mut ring| {
                        // Lengths differ per rank; rank 1's is empty.
                        let mine = vec![ring.rank() as u8; if ring.rank() == 1 { 0 } else { 3 + 1000 * ring.rank() }];
                        scope.spawn(move || ring.all_gather(mine).unwrap())
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for gathered in &results {
                assert_eq!(gathered.len(), world);
                for (rank, bytes) in gathered.iter().enumerate() {
                    let expected = if rank == 1 { 0 } else { 3 + 1000 * rank };
                    assert_eq!(bytes.len(), expected, "rank {rank} of {world}");
                    assert!(bytes.iter().all(|&b| b == rank as u8));
                }
            }
        }
        assert_eq!(Ring::alone().all_gather(vec![7]).unwrap(), vec![vec![7]]);
    }

    #[test]
    fn a_dead_rank_fails_the_all_reduce_instead_of_hanging() {
        let mut rings = loopback(3, Uuid::new_v4(), Duration::from_secs(10)).unwrap();
        drop(rings.pop());
        let errors: Vec<RingError> = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|mut ring| scope.spawn(move || ring.all_reduce(&mut [1.0; 64]).unwrap_err()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(errors.iter().all(|e| matches!(e, RingError::Peer { .. })), "{errors:?}");
    }

    #[test]
    fn ranks_out_of_step_are_refused() {
        let rings = loopback(2, Uuid::new_v4(), Duration::from_secs(10)).unwrap();
        let errors: Vec<RingError> = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|mut ring| {
                    let n = 4 + ring.rank();
                    scope.spawn(move || ring.all_reduce(&mut vec![1.0; n]).unwrap_err())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(errors.iter().all(|e| matches!(e, RingError::OutOfStep { .. })), "{errors:?}");
    }
}
