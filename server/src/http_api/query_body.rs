//! `/query`'s body read in one pass over its bytes, for the shape every router sends:
//! an object of the known fields, plain strings, and `token_ids` as an array of small
//! integers. serde_json spends most of a long query's time on that array (a visitor call
//! per token: 186 µs for 20,000 tokens where this loop takes 72, docs/benchmarks.md §15).
//!
//! Anything else (escapes, unknown or repeated fields, a number that is not a `u32`,
//! bad syntax) is left to serde (`None` here), so every answer, refusals included, is
//! exactly serde's: the tests check that on random bodies.

use super::json::QueryRequest;

/// The request, when `body` has the common shape; None to let serde read it.
pub fn read(body: &[u8]) -> Option<QueryRequest> {
    let mut r = Reader { b: body, at: 0 };
    let mut fields = Fields::default();
    r.skip_ws();
    r.eat(b'{')?;
    r.skip_ws();
    if !r.eat_if(b'}') {
        loop {
            let key = r.plain_string()?;
            r.skip_ws();
            r.eat(b':')?;
            r.skip_ws();
            fields.take(key, &mut r)?;
            r.skip_ws();
            if r.eat_if(b',') {
                r.skip_ws();
                continue;
            }
            r.eat(b'}')?;
            break;
        }
    }
    r.skip_ws();
    if r.at != body.len() {
        return None;
    }
    fields.request()
}

/// The fields seen so far; a repeated one sends the body to serde (which refuses it).
#[derive(Default)]
struct Fields {
    token_ids: Option<Vec<u32>>,
    model_name: Option<String>,
    routing_group: Option<String>,
    tenant_id: Option<String>,
    lora_name: Option<Option<String>>,
    cache_salt: Option<Option<String>>,
}

impl Fields {
    fn take(&mut self, key: &str, r: &mut Reader<'_>) -> Option<()> {
        fn once<T>(slot: &mut Option<T>, value: Option<T>) -> Option<()> {
            if slot.is_some() {
                return None;
            }
            *slot = Some(value?);
            Some(())
        }
        match key {
            "token_ids" => once(&mut self.token_ids, r.u32_array()),
            "model_name" => once(&mut self.model_name, r.owned_string()),
            "routing_group" => once(&mut self.routing_group, r.owned_string()),
            "tenant_id" => once(&mut self.tenant_id, r.owned_string()),
            "lora_name" => once(&mut self.lora_name, r.string_or_null()),
            "cache_salt" => once(&mut self.cache_salt, r.string_or_null()),
            _ => None,
        }
    }

    fn request(self) -> Option<QueryRequest> {
        let group = || "default".to_string();
        Some(QueryRequest {
            token_ids: self.token_ids?,
            model_name: self.model_name?,
            routing_group: self.routing_group.unwrap_or_else(group),
            tenant_id: self.tenant_id.unwrap_or_else(group),
            lora_name: self.lora_name.flatten(),
            cache_salt: self.cache_salt.flatten(),
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.at += 1;
        }
    }

    fn eat_if(&mut self, c: u8) -> bool {
        let here = self.peek() == Some(c);
        self.at += usize::from(here);
        here
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.eat_if(c).then_some(())
    }

    /// A string without escapes or control characters (serde reads the others).
    fn plain_string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let rest = &self.b[self.at..];
        let len = rest
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        if rest[len] != b'"' {
            return None;
        }
        let s = std::str::from_utf8(&rest[..len]).ok()?;
        self.at += len + 1;
        Some(s)
    }

    fn owned_string(&mut self) -> Option<String> {
        self.plain_string().map(str::to_string)
    }

    fn string_or_null(&mut self) -> Option<Option<String>> {
        if self.b[self.at..].starts_with(b"null") {
            self.at += 4;
            return Some(None);
        }
        self.owned_string().map(Some)
    }

    /// `[` integers `]`, each 0 or without leading zeros, at most `u32::MAX`: one loop
    /// over the bytes, each digit and separator looked at once.
    fn u32_array(&mut self) -> Option<Vec<u32>> {
        self.eat(b'[')?;
        self.skip_ws();
        // Tokens of up to 5 digits and a comma: one allocation for most bodies.
        let mut out = Vec::with_capacity((self.b.len() - self.at) / 4);
        if self.eat_if(b']') {
            return Some(out);
        }
        let (b, mut at) = (self.b, self.at);
        at = simple_tokens(b, at, &mut out);
        while matches!(b.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            at += 1;
        }
        loop {
            let first = at;
            let mut v = 0u64;
            if let Some((value, n)) = short_number(b, at) {
                (v, at) = (u64::from(value), at + n);
            } else {
                while let Some(d) = b.get(at).map(|c| c.wrapping_sub(b'0')).filter(|&d| d <= 9) {
                    v = v * 10 + u64::from(d);
                    at += 1;
                    if at - first > 10 {
                        return None;
                    }
                }
            }
            // None, a leading zero, a fraction or an exponent: serde's to judge.
            let digits = at - first;
            if digits == 0 || (digits > 1 && b[first] == b'0') || v > u64::from(u32::MAX) {
                return None;
            }
            out.push(v as u32);
            while matches!(b.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
                at += 1;
            }
            match b.get(at)? {
                b',' => at += 1,
                b']' => {
                    self.at = at + 1;
                    return Some(out);
                }
                _ => return None,
            }
            while matches!(b.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
                at += 1;
            }
        }
    }
}

/// Reads the array's tokens from `at` (a token's first byte) while they have the shape
/// serializers write: at most 8 digits, no leading zero, then a comma and at most one
/// space. Returns where the first token it did not read starts, for the general loop
/// (the array's last token, a token of another shape, the body's last 72 bytes).
///
/// The commas of 64 bytes are found at once and each token is read between two of them,
/// so no token's reading waits on the one before: where the general loop's next token
/// waits for the length of the last (13 cycles a token), this takes about 5.
fn simple_tokens(b: &[u8], mut at: usize, out: &mut Vec<u32>) -> usize {
    // A token's 8-byte read stays inside the body.
    while at + 72 <= b.len() {
        let block = at;
        let mut commas = commas_in(b[block..block + 64].try_into().expect("64 bytes"));
        if commas == 0 {
            return at;
        }
        while commas != 0 {
            let comma = block + commas.trailing_zeros() as usize;
            commas &= commas - 1;
            let len = comma - at;
            match leading_digits(b, at) {
                Some((digits, n))
                    if n >= len && (1..=8).contains(&len) && (len == 1 || b[at] != b'0') =>
                {
                    out.push(digits_value(digits, len))
                }
                _ => return at,
            }
            at = comma + 1 + usize::from(b[comma + 1] == b' ');
        }
    }
    at
}

/// Bit i set where `block[i]` is a comma.
#[cfg(target_arch = "x86_64")]
fn commas_in(block: &[u8; 64]) -> u64 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
    };
    let mut mask = 0u64;
    for (i, part) in block.chunks_exact(16).enumerate() {
        // SAFETY: SSE2 is part of x86_64; the load reads the 16 bytes of `part`, unaligned.
        let bits = unsafe {
            let v = _mm_loadu_si128(part.as_ptr().cast::<__m128i>());
            _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b',' as i8)))
        };
        mask |= u64::from(bits as u16) << (16 * i);
    }
    mask
}

/// Bit i set where `block[i]` is a comma.
#[cfg(not(target_arch = "x86_64"))]
fn commas_in(block: &[u8; 64]) -> u64 {
    block
        .iter()
        .enumerate()
        .fold(0, |mask, (i, &c)| mask | (u64::from(c == b',') << i))
}

/// The number of fewer than 8 digits at `at` and its length, read from 8 bytes at once
/// without a branch per digit (a token's length is what a branch would mispredict);
/// None near the body's end or for 8 digits or more.
fn short_number(b: &[u8], at: usize) -> Option<(u32, usize)> {
    let (digits, n) = leading_digits(b, at)?;
    (n != 0 && n != 8).then(|| (digits_value(digits, n), n))
}

/// The 8 bytes at `at` less '0' each, and how many of them are digits before the first
/// that is not; None near the body's end.
fn leading_digits(b: &[u8], at: usize) -> Option<(u64, usize)> {
    let chunk = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
    let digits = chunk.wrapping_sub(0x3030_3030_3030_3030);
    // A byte's high bit set where it is not a digit. Borrows and carries run towards
    // later bytes: those before the first non-digit are exact.
    let not_digit = (digits.wrapping_add(0x7676_7676_7676_7676) | digits) & 0x8080_8080_8080_8080;
    Some((digits, (not_digit.trailing_zeros() / 8) as usize))
}

/// The value of the first `n` (1 to 8) of `digits`' bytes, the first the most significant.
fn digits_value(digits: u64, n: usize) -> u32 {
    // The n digits moved to the top, zeros (leading zeros) below: then pairs, quads and
    // eights summed by multiplication.
    let mut v = digits << (64 - 8 * n);
    v = (v & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    v = (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32;
    v as u32
}

#[cfg(test)]
mod tests {
    use super::super::json::{parse, QueryRequest};
    use super::read;
    use proptest::prelude::*;

    fn same(a: &QueryRequest, b: &QueryRequest) -> bool {
        (
            &a.token_ids,
            &a.model_name,
            &a.routing_group,
            &a.tenant_id,
            &a.lora_name,
            &a.cache_salt,
        ) == (
            &b.token_ids,
            &b.model_name,
            &b.routing_group,
            &b.tenant_id,
            &b.lora_name,
            &b.cache_salt,
        )
    }

    /// Where the fast reader answers, serde answers the same; where serde refuses, the
    /// fast reader does not answer.
    fn agrees(body: &[u8]) {
        match (read(body), parse::<QueryRequest>(body)) {
            (Some(fast), Ok(serde)) => {
                assert!(same(&fast, &serde), "{}", String::from_utf8_lossy(body))
            }
            (Some(_), Err(e)) => panic!(
                "serde refused ({e:?}) what was read: {}",
                String::from_utf8_lossy(body)
            ),
            (None, _) => {}
        }
    }

    #[test]
    fn the_common_shape_is_read_and_equals_serde() {
        let bodies: [&[u8]; 6] = [
            br#"{"token_ids":[1,2,3],"model_name":"m"}"#,
            b" {\n\t\"model_name\" : \"m\" , \"token_ids\" : [ 0 , 4294967295 ] ,\"routing_group\":\"g\"} \r\n",
            br#"{"token_ids":[],"model_name":"m","lora_name":null,"cache_salt":"s","tenant_id":"t"}"#,
            br#"{"token_ids":[7],"model_name":"\u00e9t\u00e9 \u00e0 Paris"}"#,
            "{\"token_ids\":[7],\"model_name\":\"été\"}".as_bytes(),
            br#"{"token_ids":[5],"model_name":"m","lora_name":"a"}"#,
        ];
        for body in bodies {
            agrees(body);
        }
        let read_fast = |b: &[u8]| read(b).is_some();
        assert!(read_fast(bodies[0]) && read_fast(bodies[1]) && read_fast(bodies[2]));
        assert!(!read_fast(bodies[3]), "escapes are serde's");
    }

    #[test]
    fn every_doubt_goes_to_serde() {
        for body in [
            &br#"{"token_ids":[01],"model_name":"m"}"#[..],
            br#"{"token_ids":[1.0],"model_name":"m"}"#,
            br#"{"token_ids":[1e2],"model_name":"m"}"#,
            br#"{"token_ids":[-1],"model_name":"m"}"#,
            br#"{"token_ids":[4294967296],"model_name":"m"}"#,
            br#"{"token_ids":[99999999999],"model_name":"m"}"#,
            br#"{"token_ids":[1,],"model_name":"m"}"#,
            br#"{"token_ids":[1],"model_name":"m",}"#,
            br#"{"token_ids":[1],"model_name":"m","model_name":"n"}"#,
            br#"{"token_ids":[1],"model_name":"m","extra":1}"#,
            br#"{"token_ids":[1],"model_name":null}"#,
            br#"{"token_ids":[1],"model_name":"m","routing_group":null}"#,
            br#"{"token_ids":[1],"model_name":"m"} x"#,
            br#"{"token_ids":[1]}"#,
            br#"{"token_ids":[1],"model_name":"m","lora_name":nul}"#,
            br#"[1]"#,
            b"",
        ] {
            assert!(read(body).is_none(), "{}", String::from_utf8_lossy(body));
            agrees(body);
        }
    }

    fn token() -> impl Strategy<Value = String> {
        prop_oneof![
            (0u64..=u64::from(u32::MAX) + 10).prop_map(|n| n.to_string()),
            Just("0".into()),
            Just("007".into()),
            Just("-3".into()),
            Just("1.5".into()),
            Just("2e3".into()),
        ]
    }

    fn string_value() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z\u{e9} ]{0,6}".prop_map(|s| format!("\"{s}\"")),
            Just("null".into()),
            Just("\"a\\\"b\"".into()),
            Just("\"tab\there\"".into()),
            Just("3".into()),
        ]
    }

    fn field() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("model_name"),
            Just("routing_group"),
            Just("tenant_id"),
            Just("lora_name"),
            Just("cache_salt"),
            Just("other"),
        ];
        prop_oneof![
            proptest::collection::vec(token(), 0..6)
                .prop_map(|t| format!("\"token_ids\": [{}]", t.join(" ,"))),
            (key, string_value()).prop_map(|(k, v)| format!("\"{k}\":{v}")),
        ]
    }

    proptest! {
        #[test]
        fn random_bodies_are_read_as_serde_reads_them(
            fields in proptest::collection::vec(field(), 0..6),
            ws in "[ \t\n]{0,2}",
            tail in prop_oneof![Just(""), Just(" "), Just(","), Just("}")],
        ) {
            let body = format!("{ws}{{{}}}{tail}", fields.join(&format!(",{ws}")));
            agrees(body.as_bytes());
        }

        /// Arrays long enough for the 64-byte blocks, mostly of the simple shape, with
        /// odd tokens and separators anywhere.
        #[test]
        fn long_arrays_are_read_as_serde_reads_them(
            tokens in proptest::collection::vec(
                prop_oneof![8 => (0u32..100_000_000).prop_map(|n| n.to_string()), 1 => token()], 0..400),
            seps in proptest::collection::vec(
                prop_oneof![8 => Just(","), 8 => Just(", "), 1 => Just(" ,"), 1 => Just(",  "), 1 => Just(",\n")], 400),
        ) {
            let mut array = String::new();
            for (i, t) in tokens.iter().enumerate() {
                if i > 0 {
                    array.push_str(seps[i]);
                }
                array.push_str(t);
            }
            let body = format!(r#"{{"token_ids": [{array}], "model_name": "m"}}"#);
            agrees(body.as_bytes());
            if tokens.iter().all(|t| t.parse::<u32>().is_ok_and(|v| v.to_string() == *t)) {
                prop_assert!(read(body.as_bytes()).is_some());
            }
        }
    }
}
