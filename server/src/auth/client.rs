//! The address a request comes from, for login throttling. Behind a reverse proxy every
//! request arrives from the proxy, so one guesser would spend everyone's attempts; with
//! the proxy named in `--trusted-proxies` the client is read from `X-Forwarded-For` as
//! nginx's `real_ip_recursive` does: the rightmost address that is not a trusted proxy
//! (what a client writes further left is not believed). From any other peer the header is
//! ignored, so a client cannot pick its own bucket.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::HeaderMap;

use crate::error::Error;
use crate::state::AppState;

/// An address block, `10.0.0.0/8` or `::1` (one address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn contains(&self, address: IpAddr) -> bool {
        let address = address.to_canonical();
        match (self.network, address) {
            (IpAddr::V4(net), IpAddr::V4(a)) => same_prefix(u32::from(net).into(), u32::from(a).into(), self.prefix, 32),
            (IpAddr::V6(net), IpAddr::V6(a)) => same_prefix(u128::from(net), u128::from(a), self.prefix, 128),
            _ => false,
        }
    }
}

/// Whether the first `prefix` of the `bits` low bits of `a` and `b` agree.
fn same_prefix(a: u128, b: u128, prefix: u8, bits: u8) -> bool {
    let shift = u32::from(bits - prefix);
    shift >= 128 || (a >> shift) == (b >> shift)
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Cidr, String> {
        let wrong = || format!("'{text}' is not an IP address or block (write 10.0.0.1, 10.0.0.0/8 or fd00::/8)");
        let (address, prefix) = match text.trim().split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text.trim(), None),
        };
        let network = IpAddr::from_str(address).map_err(|_| wrong())?.to_canonical();
        let bits = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) => prefix.parse::<u8>().ok().filter(|p| *p <= bits).ok_or_else(wrong)?,
            None => bits,
        };
        Ok(Cidr { network, prefix })
    }
}

/// The client of a request from `peer`: `peer` itself unless it is one of `trusted`, else
/// the rightmost `X-Forwarded-For` address not in `trusted` (the leftmost when all are;
/// the last trusted one before an entry that is not an address).
pub fn address(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let is_trusted = |address: IpAddr| trusted.iter().any(|block| block.contains(address));
    let mut client = peer.to_canonical();
    if !is_trusted(client) {
        return client;
    }
    let forwarded: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .collect();
    for entry in forwarded.iter().rev() {
        let Some(hop) = parse_hop(entry) else { break };
        client = hop;
        if !is_trusted(hop) {
            break;
        }
    }
    client
}

/// One `X-Forwarded-For` entry: an address, maybe with a port (`[::1]:80`, `1.2.3.4:80`).
fn parse_hop(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    let address = IpAddr::from_str(entry).or_else(|_| SocketAddr::from_str(entry).map(|s| s.ip())).ok()?;
    Some(address.to_canonical())
}

/// The client address of a request ([`address`] under the server's `--trusted-proxies`).
pub struct ClientAddr(pub IpAddr);

impl FromRequestParts<AppState> for ClientAddr {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<ClientAddr, Error> {
        let ConnectInfo(peer) = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .copied()
            .ok_or(Error::Invariant("the server was started without connection info"))?;
        Ok(ClientAddr(address(peer.ip(), &parts.headers, &state.config.trusted_proxies)))
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn blocks(texts: &[&str]) -> Vec<Cidr> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    fn forwarded(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("x-forwarded-for", HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn blocks_hold_the_addresses_of_their_prefix() {
        let private = Cidr::from_str("10.0.0.0/8").unwrap();
        assert!(private.contains(ip("10.200.3.4")));
        assert!(!private.contains(ip("11.0.0.1")));
        assert!(private.contains(ip("::ffff:10.1.1.1")), "an IPv4-mapped address is its IPv4 one");
        assert!(Cidr::from_str("0.0.0.0/0").unwrap().contains(ip("203.0.113.9")));
        assert!(!Cidr::from_str("0.0.0.0/0").unwrap().contains(ip("::1")), "a v4 block holds no v6 address");
        let one = Cidr::from_str("fd00::7").unwrap();
        assert!(one.contains(ip("fd00::7")) && !one.contains(ip("fd00::8")));
        assert!(Cidr::from_str("fd00::/8").unwrap().contains(ip("fdab::1")));
        for wrong in ["10.0.0.0/33", "proxy", "10.0.0/8", "::/129", ""] {
            let error = Cidr::from_str(wrong).unwrap_err();
            assert!(error.contains("is not an IP address or block"), "{wrong}: {error}");
        }
    }

    #[test]
    fn only_a_trusted_proxy_s_forwarded_for_is_believed() {
        let trusted = blocks(&["10.0.0.0/8"]);
        let spoofed = forwarded(&["198.51.100.7"]);
        assert_eq!(address(ip("203.0.113.9"), &spoofed, &trusted), ip("203.0.113.9"), "a client names no one");
        assert_eq!(address(ip("10.0.0.2"), &spoofed, &[]), ip("10.0.0.2"), "no proxy trusted: the peer");
        assert_eq!(address(ip("10.0.0.2"), &spoofed, &trusted), ip("198.51.100.7"));
    }

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let trusted = blocks(&["10.0.0.0/8", "fd00::/8"]);
        // The client wrote 1.1.1.1 itself; the edge proxy appended the address it saw.
        let chain = forwarded(&["1.1.1.1, 203.0.113.9", "10.0.0.5"]);
        assert_eq!(address(ip("10.0.0.2"), &chain, &trusted), ip("203.0.113.9"));
        let ports = forwarded(&["[2001:db8::1]:4711, 10.0.0.5:80"]);
        assert_eq!(address(ip("fd00::1"), &ports, &trusted), ip("2001:db8::1"));
        let inside = forwarded(&["10.0.0.9, 10.0.0.5"]);
        assert_eq!(address(ip("10.0.0.2"), &inside, &trusted), ip("10.0.0.9"), "all trusted: the leftmost");
        let garbled = forwarded(&["203.0.113.9, unknown, 10.0.0.5"]);
        assert_eq!(address(ip("10.0.0.2"), &garbled, &trusted), ip("10.0.0.5"), "not past an entry it cannot read");
        assert_eq!(address(ip("10.0.0.2"), &HeaderMap::new(), &trusted), ip("10.0.0.2"), "no header: the proxy");
    }
}
