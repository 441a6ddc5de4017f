//! Reading a payload's msgpack in one pass: the structure into `rmpv::Value`s, except
//! the stores' token ids, read straight into their vectors. A `Value` tree holds 32
//! bytes and an array slot per token, which made decoding most of the ingest's work.
//!
//! A store's `token_ids` (field 3 of an event array tagged `"BlockStored"`, or the first
//! `"token_ids"` entry of an event map) is kept in [`Read::tokens`] under its event's
//! index, and left in the tree as an empty array.

use rmp::Marker;
use rmpv::Value;

/// Token ids of one store, or the index of the first item that is not a token id (an
/// integer in 0..2^32, or a pair whose first is one: SGLang's EAGLE bigram pages send
/// each token as the pair (token, next token)).
pub type TokenIds = Result<Vec<u32>, usize>;

/// What one pass read.
pub struct Read {
    pub value: Value,
    /// Per event of the batch's `events` array, its token ids if it had an array of them.
    pub tokens: Vec<Option<TokenIds>>,
}

/// Reads the one value at the start of `bytes` (nested at most `max_depth` deep),
/// returning it and the bytes after it.
pub fn read(bytes: &[u8], max_depth: usize) -> Result<(Read, &[u8]), String> {
    let mut r = Reader {
        rd: bytes,
        tokens: Vec::new(),
        max_depth,
    };
    let value = r.batch()?;
    Ok((
        Read {
            value,
            tokens: r.tokens,
        },
        r.rd,
    ))
}

struct Reader<'a> {
    rd: &'a [u8],
    tokens: Vec<Option<TokenIds>>,
    max_depth: usize,
}

impl Reader<'_> {
    fn marker(&self) -> Option<Marker> {
        self.rd.first().map(|&b| Marker::from_u8(b))
    }

    /// Any value, `depth` containers down.
    fn value(&mut self, depth: usize) -> Result<Value, String> {
        let left = self.max_depth.saturating_sub(depth);
        rmpv::decode::read_value_with_max_depth(&mut self.rd, left).map_err(|e| e.to_string())
    }

    /// A container header coming next (`maps`: a map's, else an array's), read; None
    /// (nothing read) if none comes, or it would nest past the limit at `depth`.
    fn header(&mut self, maps: bool, depth: usize) -> Result<Option<usize>, String> {
        let is = match self.marker() {
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => !maps,
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => maps,
            _ => false,
        };
        if !is || depth >= self.max_depth {
            return Ok(None);
        }
        let n = if maps {
            rmp::decode::read_map_len(&mut self.rd)
        } else {
            rmp::decode::read_array_len(&mut self.rd)
        };
        n.map(|n| Some(n as usize)).map_err(|e| e.to_string())
    }

    /// A struct encoded as an array or a map, `depth` containers down, whose field at
    /// `pos` (of an array whose first item is `tag`, if one is given) or first field
    /// named `name` is read by `field`; the others, and anything else, as values.
    fn record(
        &mut self,
        depth: usize,
        (pos, tag, name): (usize, Option<&str>, &str),
        field: fn(&mut Self) -> Result<Value, String>,
    ) -> Result<Value, String> {
        if let Some(n) = self.header(false, depth)? {
            let mut items = Vec::with_capacity(n.min(16));
            for i in 0..n {
                let tagged = tag.is_none_or(|t| items.first().and_then(Value::as_str) == Some(t));
                items.push(if i == pos && tagged {
                    field(self)?
                } else {
                    self.value(depth + 1)?
                });
            }
            return Ok(Value::Array(items));
        }
        if let Some(n) = self.header(true, depth)? {
            let mut pairs = Vec::with_capacity(n.min(16));
            let mut seen = false;
            for _ in 0..n {
                let k = self.value(depth + 1)?;
                let v = if !seen && k.as_str() == Some(name) {
                    seen = true;
                    field(self)?
                } else {
                    self.value(depth + 1)?
                };
                pairs.push((k, v));
            }
            return Ok(Value::Map(pairs));
        }
        self.value(depth)
    }

    /// `[ts, events, rank]` or a map of them.
    fn batch(&mut self) -> Result<Value, String> {
        self.record(0, (1, None, "events"), Self::events)
    }

    fn events(&mut self) -> Result<Value, String> {
        let Some(n) = self.header(false, 1)? else {
            return self.value(1);
        };
        let mut events = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            self.tokens.push(None);
            events.push(self.event()?);
        }
        Ok(Value::Array(events))
    }

    /// A tagged array or a map with `"type"`: a store's token ids are read aside.
    fn event(&mut self) -> Result<Value, String> {
        self.record(2, (3, Some("BlockStored"), "token_ids"), Self::token_ids)
    }

    /// An array of token ids into the event's entry of [`Reader::tokens`], an empty
    /// array in its place; anything else as a value.
    fn token_ids(&mut self) -> Result<Value, String> {
        let Some(n) = self.header(false, 3)? else {
            return self.value(3);
        };
        // Each id takes a byte at least: a header cannot reserve more than the payload holds.
        let mut ids = Vec::with_capacity(n.min(self.rd.len()));
        let mut bad = None;
        for index in 0..n {
            let id = match self.uint() {
                Some(t) => Some(t),
                None if self.marker() == Some(Marker::FixArray(2)) && self.max_depth > 5 => {
                    self.rd = &self.rd[1..];
                    let first = self.uint();
                    if first.is_none() {
                        self.value(5)?;
                    }
                    self.value(5)?;
                    first
                }
                None => {
                    self.value(4)?;
                    None
                }
            };
            match id.and_then(|t| u32::try_from(t).ok()) {
                Some(t) if bad.is_none() => ids.push(t),
                Some(_) => {}
                None => {
                    bad.get_or_insert(index);
                }
            }
        }
        if let Some(entry) = self.tokens.last_mut() {
            *entry = Some(bad.map_or(Ok(ids), Err));
        }
        Ok(Value::Array(Vec::new()))
    }

    /// The integer that comes next, read, if it is one in 0..2^64 (as
    /// `Value::as_u64`); nothing read otherwise.
    fn uint(&mut self) -> Option<u64> {
        let b = self.rd;
        let be = |n: usize| {
            b.get(1..1 + n)
                .map(|x| x.iter().fold(0u64, |a, &y| a << 8 | u64::from(y)))
        };
        let signed = |v: Option<u64>, bits: u32| {
            v.and_then(|v| u64::try_from(((v << (64 - bits)) as i64) >> (64 - bits)).ok())
        };
        let (len, v) = match Marker::from_u8(*b.first()?) {
            Marker::FixPos(n) => (1, Some(u64::from(n))),
            Marker::U8 => (2, be(1)),
            Marker::U16 => (3, be(2)),
            Marker::U32 => (5, be(4)),
            Marker::U64 => (9, be(8)),
            Marker::I8 => (2, signed(be(1), 8)),
            Marker::I16 => (3, signed(be(2), 16)),
            Marker::I32 => (5, signed(be(4), 32)),
            Marker::I64 => (9, signed(be(8), 64)),
            _ => return None,
        };
        let v = v?;
        self.rd = &b[len..];
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    /// `want` (rmpv's tree) with each event's token ids as the one pass keeps them:
    /// None where the event has none (or they are not all token ids).
    fn expected_tokens(want: &Value) -> Vec<Option<TokenIds>> {
        let events = match want {
            Value::Array(items) => items.get(1),
            Value::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("events"))
                .map(|(_, v)| v),
            _ => None,
        };
        let Some(Value::Array(events)) = events else {
            return Vec::new();
        };
        events
            .iter()
            .map(|e| {
                let ids = match e {
                    Value::Array(items)
                        if items.first().and_then(Value::as_str) == Some("BlockStored") =>
                    {
                        items.get(3)
                    }
                    Value::Map(pairs) => pairs
                        .iter()
                        .find(|(k, _)| k.as_str() == Some("token_ids"))
                        .map(|(_, v)| v),
                    _ => None,
                };
                let Some(Value::Array(ids)) = ids else {
                    return None;
                };
                let one = |t: &Value| {
                    let t = match t {
                        Value::Array(pair) if pair.len() == 2 => &pair[0],
                        t => t,
                    };
                    t.as_u64().and_then(|t| u32::try_from(t).ok())
                };
                Some(
                    ids.iter()
                        .enumerate()
                        .map(|(i, t)| one(t).ok_or(i))
                        .collect::<Result<Vec<u32>, usize>>(),
                )
            })
            .collect()
    }

    /// `want` with the token ids the one pass keeps aside emptied.
    fn without_tokens(want: &Value, tokens: &[Option<TokenIds>]) -> Value {
        let mut v = want.clone();
        let events = match &mut v {
            Value::Array(items) => items.get_mut(1),
            Value::Map(pairs) => pairs
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some("events"))
                .map(|(_, v)| v),
            _ => None,
        };
        if let Some(Value::Array(events)) = events {
            for (e, t) in events.iter_mut().zip(tokens) {
                if t.is_none() {
                    continue;
                }
                let slot = match e {
                    Value::Array(items) => items.get_mut(3),
                    Value::Map(pairs) => pairs
                        .iter_mut()
                        .find(|(k, _)| k.as_str() == Some("token_ids"))
                        .map(|(_, v)| v),
                    _ => None,
                };
                if let Some(slot) = slot {
                    *slot = Value::Array(Vec::new());
                }
            }
        }
        v
    }

    fn arb_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::Boolean),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u32..70_000).prop_map(Value::from),
            (-1e9f64..1e9).prop_map(Value::F64),
            ".{0,12}".prop_map(Value::from),
            Just(Value::from("BlockStored")),
            Just(Value::from("token_ids")),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
            (any::<i8>(), proptest::collection::vec(any::<u8>(), 0..6))
                .prop_map(|(t, d)| Value::Ext(t, d)),
        ]
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        arb_leaf().prop_recursive(5, 96, 12, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..12).prop_map(Value::Array),
                proptest::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Map),
            ]
        })
    }

    /// Batches shaped like the engines' (arrays and maps, stores with token ids that
    /// are ints, pairs or not tokens at all) and anything else.
    fn arb_payload() -> impl Strategy<Value = Value> {
        let token = prop_oneof![
            (0u64..70_000).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (0u32..9, any::<i64>())
                .prop_map(|(a, b)| Value::Array(vec![Value::from(a), Value::from(b)])),
            arb_leaf(),
        ];
        let ids = proptest::collection::vec(token, 0..20).prop_map(Value::Array);
        let stored = (ids.clone(), arb_value(), any::<bool>()).prop_map(|(ids, other, as_map)| {
            if as_map {
                Value::Map(vec![
                    (Value::from("type"), Value::from("BlockStored")),
                    (Value::from("token_ids"), ids.clone()),
                    (Value::from("token_ids"), ids),
                    (Value::from("x"), other),
                ])
            } else {
                Value::Array(vec![
                    Value::from("BlockStored"),
                    other.clone(),
                    Value::Nil,
                    ids,
                    other,
                ])
            }
        });
        let event = prop_oneof![stored, arb_value()];
        let events = proptest::collection::vec(event, 0..5).prop_map(Value::Array);
        prop_oneof![
            (events.clone(), arb_leaf()).prop_map(|(e, l)| Value::Array(vec![
                Value::F64(1.0),
                e,
                l
            ])),
            (events, arb_leaf(), any::<bool>()).prop_map(|(e, l, twice)| {
                let mut pairs = vec![(Value::from("ts"), Value::F64(1.0))];
                if twice {
                    pairs.push((Value::from("events"), l));
                }
                pairs.push((Value::from("events"), e));
                Value::Map(pairs)
            }),
            arb_value(),
        ]
    }

    proptest! {
        /// One pass reads what rmpv reads: the same tree but for the token ids it keeps
        /// aside, which are each store's token ids as rmpv reads them; the same bytes
        /// left over; an error where rmpv has one.
        #[test]
        fn one_pass_reads_what_rmpv_reads(v in arb_payload(), tail in proptest::collection::vec(any::<u8>(), 0..3)) {
            let mut bytes = enc(&v);
            bytes.extend_from_slice(&tail);
            let mut rd = &bytes[..];
            let reference = rmpv::decode::read_value_with_max_depth(&mut rd, 16);
            match (read(&bytes, 16), reference) {
                (Ok((got, rest)), Ok(want)) => {
                    prop_assert_eq!(rest, rd);
                    prop_assert_eq!(&got.tokens, &expected_tokens(&want));
                    prop_assert_eq!(&got.value, &without_tokens(&want, &got.tokens));
                }
                (Err(_), Err(_)) => {}
                (got, want) => prop_assert!(false, "{:?} vs {:?}", got.map(|r| r.0.value), want),
            }
        }

        /// Broken bytes are an error, never a panic.
        #[test]
        fn broken_bytes_never_panic(v in arb_value(), cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>()) {
            let mut bytes = enc(&v);
            let i = flip.0.index(bytes.len());
            bytes[i] ^= flip.1;
            bytes.truncate(cut.index(bytes.len() + 1));
            let _ = read(&bytes, 16);
        }
    }

    #[test]
    fn every_integer_marker_reads_as_rmpv_reads_it() {
        let cases: [&[u8]; 9] = [
            &[0xd0, 0x05],
            &[0xd0, 0xff],
            &[0xd1, 0x01, 0x00],
            &[0xd2, 0x80, 0, 0, 0],
            &[0xd3, 0, 0, 0, 0, 0, 0, 0, 7],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            &[0xcc, 0xc8],
            &[0xe0],
            &[0xcd, 0x01],
        ];
        for bytes in cases {
            let mut r = Reader {
                rd: bytes,
                tokens: Vec::new(),
                max_depth: 16,
            };
            let mut rd = bytes;
            let want = rmpv::decode::read_value(&mut rd)
                .ok()
                .and_then(|v| v.as_u64());
            assert_eq!(r.uint(), want, "{bytes:02x?}");
            assert_eq!(
                r.rd.is_empty(),
                want.is_some(),
                "{bytes:02x?}: consumed when read"
            );
        }
    }
}
