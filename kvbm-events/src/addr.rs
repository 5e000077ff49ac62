//! `HOST:PORT`, the part every address the tools take ends in: the
//! attach server's `http://`, vLLM's `zmq://`, NATS's `nats://`. Read in
//! one place, so that each refuses the same mistakes in the same words;
//! each caller reads its own scheme and what its URLs may carry besides
//! (NATS credentials, say) first.

/// Longest host name accepted: a DNS name is at most 253 characters.
const MAX_HOST: usize = 253;

/// The host and port of `authority` (`HOST:PORT`, `HOST` a DNS name, an
/// IPv4 address or a bracketed IPv6 address, returned without its
/// brackets), or why it is not one, in a few words for the caller's own
/// message to quote. Never panics.
pub fn parse_authority(authority: &str) -> Result<(&str, u16), &'static str> {
    if authority.contains(['/', '?', '#']) {
        return Err("a path, query or fragment is not expected");
    }
    if authority.contains('@') {
        return Err("user info is not expected");
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let Some((addr, after)) = v6.split_once(']') else {
            return Err("an IPv6 address needs its closing `]`");
        };
        if addr.parse::<std::net::Ipv6Addr>().is_err() {
            return Err("not an IPv6 address inside `[...]`");
        }
        let Some(port) = after.strip_prefix(':') else {
            return Err("no port");
        };
        (addr, port)
    } else {
        let Some((host, port)) = authority.rsplit_once(':') else {
            return Err("no port");
        };
        if host.is_empty() {
            return Err("no host");
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
        if host.len() > MAX_HOST || !host.chars().all(ok) {
            return Err("the host must be a name or an IP address");
        }
        (host, port)
    };
    // `u16::from_str` takes a leading `+`; a port is digits alone.
    match port.parse::<u16>() {
        Ok(p) if p != 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok((host, p)),
        _ => Err("the port must be a number from 1 to 65535"),
    }
}

/// `host:port` as a URL spells it: an IPv6 address in brackets.
pub fn join_authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hosts_and_ports_parse_or_say_why() {
        assert_eq!(parse_authority("127.0.0.1:6669"), Ok(("127.0.0.1", 6669)));
        assert_eq!(parse_authority("my-host.local:1"), Ok(("my-host.local", 1)));
        assert_eq!(parse_authority("[::1]:9000"), Ok(("::1", 9000)));
        for (bad, why) in [
            ("h", "no port"),
            ("[::1]", "no port"),
            (":80", "no host"),
            ("h:0", "port"),
            ("h:70000", "port"),
            ("h:+80", "port"),
            ("h:", "port"),
            ("h:80/x", "path"),
            ("h:80?x", "query"),
            ("u:p@h:80", "user info"),
            ("[::1:80", "closing"),
            ("[zz]:80", "IPv6"),
            ("a b:80", "host"),
        ] {
            let e = parse_authority(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(parse_authority(&format!("{}:1", "a".repeat(254))).is_err());
        assert!(parse_authority(&format!("{}:1", "a".repeat(253))).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn what_parses_joins_back_to_itself(s in ".{0,40}", host in "[a-z0-9.:\\[\\]_-]{0,20}", port in any::<u32>()) {
            let _ = parse_authority(&s);
            let given = format!("{host}:{port}");
            if let Ok((h, p)) = parse_authority(&given) {
                let joined = join_authority(h, p);
                prop_assert_eq!(parse_authority(&joined), Ok((h, p)));
            }
        }
    }
}
