//! Engine events → kvix events, for one holder (one engine stream). Pure state, no I/O.
//!
//! The engine's own block hashes depend on its hash seed, so a gateway cannot compute
//! them: each stored block's `token_ids` are rehashed into the keyspace chain. A store
//! whose parent is an engine hash continues from what this map remembers of that block
//! (its keyspace, the chain hash at its last lane-block boundary, its end in tokens and
//! any tokens past that boundary); a store with an unknown parent is skipped and
//! counted, never guessed.
//!
//! Identity: a LoRA name and a cache salt choose the keyspace (a salted prompt's
//! continuations inherit it from their parent); every other extra key is mixed into the
//! chain ([`chain::mix_extra`]), so a block stored with keys never matches a prompt
//! without them.
//!
//! Pages smaller than the lane's block (SGLang's default page of 1 token, a partial last
//! page) accumulate: a lane block is stored once its last token is, named by the page
//! that completed it; a page that completed no lane block names nothing in the index.
//!
//! Tiers: a store names its medium's tier (GPU stores go out as `Stored`, others as
//! `StoredIn`). A block leaves a tier when its last copy there is removed: as
//! `RemovedFrom` while another tier still holds it, as `Removed` (every tier, and its
//! names) once none does. A placeholder store (no tokens: vLLM's offloading connector
//! without self-describing events) is a copy of a block this map knows by hash; one it
//! does not know is counted and dropped. Stores and removals said to be remote, of a
//! secondary offloading tier (`ownership`), or of a medium no engine documents are
//! counted and dropped, as Dynamo's indexer drops them.

use std::collections::HashMap;

use kvix_wire::chain::{self, ExtraKey};
use kvix_wire::{ChunkKind, Event, Keyspace, Lane, LaneKind, Tier};
use rkyv::{Archive, Deserialize, Serialize};

use crate::payload::{Batch, EngineEvent, Locality, Medium, Removed, Stored};
use crate::pending::{self, Pending};
use kvix_engine::{Interner, KeyMap};

/// Why an event was skipped (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Skip {
    /// A store whose parent hash this stream never stored (or already removed).
    UnknownParent,
    /// group_idx beyond the roster, or its block size / kind / window differs.
    LaneMismatch,
    /// token_ids is not block_hashes × block_size tokens, or positions overflow.
    BadStore,
    /// An event type the decoder does not know.
    UnknownEvent,
    /// A `kv_cache_spec_kind` with no lane kind (cross attention, encoder only, unknown).
    UnsupportedKind,
    /// Extra keys on pages smaller than the lane block (no engine sends these today).
    ExtraKeysInPages,
    /// A medium no engine documents (vLLM connectors' `FS`, `OBJ`, ...).
    UnknownMedium,
    /// Said to be held remotely (`locality` REMOTE or unknown): not this worker's.
    NotLocal,
    /// Stored or removed by a secondary offloading tier (`ownership` set).
    SecondaryTier,
    /// A placeholder naming a hash this stream never stored (or already removed).
    UnknownPlaceholder,
    /// A placeholder on a lane whose engine block spans several keyspace blocks: its
    /// position is not known here.
    PlaceholderCoarseLane,
}

/// The labels of [`SKIPS`], in its order.
pub const SKIP_LABELS: [&str; SKIPS.len()] = {
    let mut out = [""; SKIPS.len()];
    let mut i = 0;
    while i < SKIPS.len() {
        out[i] = SKIPS[i].1;
        i += 1;
    }
    out
};

pub const SKIPS: [(Skip, &str); 11] = [
    (Skip::UnknownParent, "unknown_parent"),
    (Skip::LaneMismatch, "lane_mismatch"),
    (Skip::BadStore, "bad_store"),
    (Skip::UnknownEvent, "unknown_event"),
    (Skip::UnsupportedKind, "unsupported_kind"),
    (Skip::ExtraKeysInPages, "extra_keys_in_pages"),
    (Skip::UnknownMedium, "unknown_medium"),
    (Skip::NotLocal, "not_local"),
    (Skip::SecondaryTier, "secondary_tier"),
    (Skip::UnknownPlaceholder, "unknown_placeholder"),
    (Skip::PlaceholderCoarseLane, "placeholder_coarse_lane"),
];

/// What one batch did, for the metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub skipped: [u64; SKIPS.len()],
    /// Engine blocks stored / removed, by tier (`Tier::ALL` order).
    pub stored: [u64; 3],
    pub removed: [u64; 3],
    /// Removals naming a block this stream does not hold.
    pub unknown_removals: u64,
    /// Stores whose blocks carry extra keys (mixed into their chain).
    pub extra_keys: u64,
    /// Stores that start a salted prompt (the salt chose their keyspace).
    pub salted: u64,
}

/// The tier an event's blocks go to, or why it is dropped.
fn tier_of(medium: Medium, locality: Locality, secondary: bool) -> Result<Tier, Skip> {
    if locality != Locality::Local {
        return Err(Skip::NotLocal);
    }
    if secondary {
        return Err(Skip::SecondaryTier);
    }
    medium.tier().ok_or(Skip::UnknownMedium)
}

/// The kvix event storing `chain` in `tier`.
fn stored_in(
    tier: Tier,
    lane: u8,
    start: u32,
    parent: Option<u64>,
    chain: Vec<u64>,
    engine: Vec<u64>,
) -> Event {
    match tier {
        Tier::Gpu => Event::Stored {
            lane,
            start,
            parent,
            chain,
            engine,
        },
        tier => Event::StoredIn {
            tier,
            lane,
            start,
            parent,
            chain,
            engine,
        },
    }
}

/// What the map remembers of one engine block: [`Entry`], with its pending tokens a
/// view shared with the other pages of its lane block.
#[derive(Debug, Clone, Default)]
struct Known {
    ks: u32,
    chain: u64,
    end: u64,
    copies: Copies,
    named: bool,
    pending: Pending,
}

/// Physical copies of one engine hash, per tier (`Tier::ALL` order). vLLM stores a
/// block again under the same hash (a recomputed last block lands in a second physical
/// block) and removes each copy on its own: a tier holds the hash until its last copy
/// there goes. A count saturates at 255, past which one removal too many reads as the
/// last.
pub type Copies = [u8; 3];

fn held(c: &Copies) -> bool {
    c.iter().any(|&n| n > 0)
}

/// One engine block as a snapshot keeps it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Index of its keyspace in [`Translator::keyspace`].
    pub ks: u32,
    /// Chain hash at the last lane-block boundary at or before its end (the keyspace
    /// seed at token 0).
    pub chain: u64,
    /// Tokens from the start of the prompt to its end.
    pub end: u64,
    /// Physical copies held, per tier.
    pub copies: Copies,
    /// Whether it completed a lane block, i.e. names blocks in the server's feed.
    pub named: bool,
    /// Its tokens past the boundary (fewer than a lane block; pages only).
    pub pending: Vec<u32>,
}

/// A translator as plain data, for snapshots.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct TranslatorImage {
    pub keyspaces: Vec<Keyspace>,
    /// Per lane, every engine block it tracks.
    pub lanes: Vec<Vec<(u64, Entry)>>,
}

/// kvix events of one batch in one keyspace, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Its keyspace ([`Translator::keyspace`], [`Translator::seed`]), kept until the
    /// next [`Translator::apply`].
    pub ks: u32,
    pub events: Vec<Event>,
}

/// How far ahead of the block it is at a store or removal loads map entries.
const PREFETCH: usize = 64;

/// The engine-hash map of one holder.
#[derive(Debug)]
pub struct Translator {
    block: u32,
    model: String,
    salt: String,
    lanes: Vec<Lane>,
    /// Counted by the entries in `maps` (and the last batch's groups): a keyspace per
    /// salted request comes and goes.
    keyspaces: Interner<Keyspace>,
    /// Chain seed of each keyspace index.
    seeds: Vec<u64>,
    /// Per lane: engine hash → what it names.
    maps: Vec<KeyMap<Known>>,
    /// Keyspaces of the last batch's groups, kept until the next one.
    grouped: Vec<u32>,
}

impl Translator {
    /// A translator for a holder with `lanes`, rehashing into `block`-token keyspace
    /// blocks of `model`; `salt` is the keyspace salt of blocks the engine did not salt.
    pub fn new(block: u32, model: &str, salt: &str, lanes: &[Lane]) -> Self {
        Translator {
            block,
            model: model.to_string(),
            salt: salt.to_string(),
            lanes: lanes.to_vec(),
            keyspaces: Interner::default(),
            seeds: Vec::new(),
            maps: lanes.iter().map(|_| KeyMap::default()).collect(),
            grouped: Vec::new(),
        }
    }

    /// Engine blocks tracked, over all lanes.
    pub fn tracked(&self) -> usize {
        self.maps.iter().map(KeyMap::len).sum()
    }

    /// Forgets every block (the engine restarted or cleared).
    pub fn reset(&mut self) {
        for m in &mut self.maps {
            for (_, e) in std::mem::take(m).iter() {
                self.keyspaces.release(e.ks);
            }
        }
    }

    /// Keyspace indexes allocated (in use or waiting to be reused).
    pub fn keyspace_slots(&self) -> usize {
        self.keyspaces.slots()
    }

    /// Keyspace `ks` of a [`Group`].
    pub fn keyspace(&self, ks: u32) -> &Keyspace {
        self.keyspaces.key(ks)
    }

    /// The chain seed of keyspace `ks`.
    pub fn seed(&self, ks: u32) -> u64 {
        self.seeds[ks as usize]
    }

    /// The keyspace of a prompt: the base model unless it names a LoRA adapter (one known
    /// only by id gets `lora-id:N`, so it never mixes with the base model); the engine's
    /// cache salt, else the source's salt.
    fn intern(&mut self, lora_name: Option<&str>, lora_id: Option<i64>, salt: Option<&str>) -> u32 {
        let lora = match (lora_name, lora_id) {
            (Some(name), _) => name.to_string(),
            (None, Some(id)) => format!("lora-id:{id}"),
            (None, None) => String::new(),
        };
        let ks = Keyspace {
            model: self.model.clone(),
            lora,
            salt: salt.unwrap_or(&self.salt).to_string(),
            kind: ChunkKind::Tokens,
        };
        self.intern_key(&ks)
    }

    fn intern_key(&mut self, ks: &Keyspace) -> u32 {
        if let Some(i) = self.keyspaces.get(ks) {
            return i;
        }
        let i = self.keyspaces.intern(ks);
        if i as usize == self.seeds.len() {
            self.seeds.push(0);
        }
        self.seeds[i as usize] = ks.seed(self.block);
        i
    }

    /// Whether lane `spec`'s blocks go out named by their chain hash (a lane block of one
    /// keyspace block: a removal names the chain hash this map keeps, so the feed needs
    /// no second map of engine hashes) rather than by engine hash.
    fn by_chain(&self, spec: &Lane) -> bool {
        spec.block_tokens == self.block
    }

    /// The keyspace clears are filed under (any of the holder's would do).
    fn base(&mut self) -> u32 {
        self.intern(None, None, None)
    }

    /// Translates one decoded batch, appending kvix events to `out` grouped in order by
    /// keyspace.
    pub fn apply(&mut self, batch: &Batch, out: &mut Vec<Group>, counts: &mut Counts) {
        self.apply_events(&batch.events, out, counts);
    }

    /// Translates `events` (a batch, or one of its [`steps`]) into `out`. The groups of
    /// the call before must be used up by then: their keyspaces are released here.
    pub fn apply_events(
        &mut self,
        events: &[EngineEvent],
        out: &mut Vec<Group>,
        counts: &mut Counts,
    ) {
        for ks in std::mem::take(&mut self.grouped) {
            self.keyspaces.release(ks);
        }
        for ev in events {
            let grouped = out.len();
            match ev {
                EngineEvent::Stored(st) => match self.store(st, counts) {
                    Ok(Some((ks, event))) => push(out, ks, event),
                    Ok(None) => {}
                    Err(skip) => counts.skipped[skip as usize] += 1,
                },
                EngineEvent::Removed(rm) => {
                    if let Err(skip) = self.remove(rm, out, counts) {
                        counts.skipped[skip as usize] += 1;
                    }
                }
                EngineEvent::Cleared => {
                    self.reset();
                    let ks = self.base();
                    push(out, ks, Event::Cleared);
                }
                EngineEvent::Unknown(_) => counts.skipped[Skip::UnknownEvent as usize] += 1,
            }
            // A group's keyspace is held until the next batch: one whose blocks all went
            // is not given to a new keyspace while a group still names it.
            for g in &out[grouped..] {
                self.keyspaces.acquire(g.ks);
                self.grouped.push(g.ks);
            }
        }
    }

    fn lane(&self, group: u32) -> Result<(u8, Lane), Skip> {
        let lane = self
            .lanes
            .get(group as usize)
            .filter(|_| group < 256)
            .ok_or(Skip::LaneMismatch)?;
        Ok((group as u8, *lane))
    }

    fn store(&mut self, st: &Stored, counts: &mut Counts) -> Result<Option<(u32, Event)>, Skip> {
        let tier = tier_of(st.medium, st.locality, st.secondary)?;
        let (lane, spec) = self.lane(st.group_idx)?;
        if st.is_placeholder() {
            return self.copy(st, tier, lane, spec, counts);
        }
        if let Some(kind) = st.spec_kind.as_deref() {
            match LaneKind::from_parts(kind, None).or_else(|_| {
                LaneKind::from_parts(kind, Some(st.sliding_window.unwrap_or(1).max(1)))
            }) {
                Err(_) => return Err(Skip::UnsupportedKind),
                Ok(k) if !same_kind(spec.kind, k, st.sliding_window) => {
                    return Err(Skip::LaneMismatch)
                }
                Ok(_) => {}
            }
        }
        let (b, l, p) = (
            self.block as usize,
            spec.block_tokens as usize,
            st.block_size as usize,
        );
        if p > l || l % b != 0 {
            return Err(Skip::LaneMismatch);
        }
        let n = st.block_hashes.len();
        if st.token_ids.len() != n * p {
            return Err(Skip::BadStore);
        }
        let keyed = st.extras.iter().any(|k| !k.is_empty());
        if keyed && p < l {
            return Err(Skip::ExtraKeysInPages);
        }
        if n == 0 {
            return Ok(None);
        }
        let (ks, mut chain, mut end, mut pending) = match st.parent {
            None => {
                if st.cache_salt.is_some() {
                    counts.salted += 1;
                }
                let ks = self.intern(
                    st.lora_name.as_deref(),
                    st.lora_id,
                    st.cache_salt.as_deref(),
                );
                (ks, self.seeds[ks as usize], 0u64, Pending::default())
            }
            Some(parent) => {
                let e = self.maps[lane as usize]
                    .get(parent)
                    .ok_or(Skip::UnknownParent)?;
                (e.ks, e.chain, e.end, e.pending.clone())
            }
        };
        let boundary = end - pending.len() as u64;
        if (end + (n * p) as u64) / b as u64 > u64::from(u32::MAX) {
            return Err(Skip::BadStore);
        }
        if keyed {
            counts.extra_keys += 1;
        }
        let before = chain;
        let mut hashes: Vec<u64> = Vec::with_capacity(n * p / b + 1);
        let by_name = !self.by_chain(&spec);
        let mut names = Vec::new();
        let m = tier as usize;
        // Every block's map entry is loaded at once, not one miss after another.
        let map = &mut self.maps[lane as usize];
        map.reserve(n);
        for &h in st.block_hashes.iter().take(PREFETCH) {
            map.prefetch(h);
        }
        for (j, (&h, tokens)) in st
            .block_hashes
            .iter()
            .zip(st.token_ids.chunks_exact(p))
            .enumerate()
        {
            if let Some(&ahead) = st.block_hashes.get(j + PREFETCH) {
                self.maps[lane as usize].prefetch(ahead);
            }
            end += p as u64;
            // A page is at most a lane block, so it completes at most one.
            let named = pending.len() + p >= l;
            if named {
                let keys = st.extras.get(j).map_or(&[][..], |k| &k[..]);
                let take = l - pending.len();
                chain = if take == l {
                    lane_block(chain, self.block, &tokens[..l], keys, &mut hashes)
                } else {
                    pending.push(&tokens[..take]);
                    pending.with(|t| lane_block(chain, self.block, t, keys, &mut hashes))
                };
                pending = Pending::from_tokens(&tokens[take..]);
                if by_name {
                    names.push(h);
                }
            } else {
                pending.push(tokens);
            }
            let e = self.maps[lane as usize].get_or_insert_with(h, || {
                self.keyspaces.acquire(ks);
                Known {
                    ks,
                    chain,
                    end,
                    copies: [0; 3],
                    named: false,
                    pending: Pending::default(),
                }
            });
            // A hash stored again is one copy more (see [`Copies`]); one stored at
            // another position (a hash collision) takes the newest position.
            if e.ks != ks {
                self.keyspaces.acquire(ks);
                self.keyspaces.release(std::mem::replace(&mut e.ks, ks));
            }
            e.chain = chain;
            e.end = end;
            e.named |= named;
            e.copies[m] = e.copies[m].saturating_add(1);
            e.pending = pending.clone();
        }
        counts.stored[m] += n as u64;
        if hashes.is_empty() {
            return Ok(None);
        }
        // The chain hash before the store seeds it: naming it lets the index extend the
        // parent's run (decode streams store one block at a time).
        let parent = (boundary > 0).then_some(before);
        let start = (boundary / b as u64) as u32;
        Ok(Some((
            ks,
            stored_in(tier, lane, start, parent, hashes, names),
        )))
    }

    /// A placeholder: another copy, in `tier`, of blocks this map knows by engine hash.
    fn copy(
        &mut self,
        st: &Stored,
        tier: Tier,
        lane: u8,
        spec: Lane,
        counts: &mut Counts,
    ) -> Result<Option<(u32, Event)>, Skip> {
        let by_chain = self.by_chain(&spec);
        let map = &mut self.maps[lane as usize];
        let mut out: Option<(u32, Vec<u64>, u32)> = None;
        for &h in &st.block_hashes {
            let Some(e) = map.get_mut(h) else {
                counts.skipped[Skip::UnknownPlaceholder as usize] += 1;
                continue;
            };
            if !by_chain {
                counts.skipped[Skip::PlaceholderCoarseLane as usize] += 1;
                continue;
            }
            e.copies[tier as usize] = e.copies[tier as usize].saturating_add(1);
            counts.stored[tier as usize] += 1;
            if !e.named {
                continue;
            }
            // A lane block of one keyspace block: the block ending at `end`.
            let pos = (e.end / u64::from(self.block)).saturating_sub(1) as u32;
            match &mut out {
                // The blocks of one placeholder are consecutive (a chunk): one run.
                Some((ks, chain, start)) if *ks == e.ks && *start + chain.len() as u32 == pos => {
                    chain.push(e.chain)
                }
                Some(_) => {}
                None => out = Some((e.ks, vec![e.chain], pos)),
            }
        }
        Ok(out.map(|(ks, chain, start)| (ks, stored_in(tier, lane, start, None, chain, vec![]))))
    }

    /// Appends the removal's named blocks to `out`, each run of hashes under the keyspace
    /// that stored them (the server looks a removal up in its batch's keyspace first):
    /// `RemovedFrom` for blocks another tier still holds, `Removed` for blocks that left
    /// every tier.
    fn remove(
        &mut self,
        rm: &Removed,
        out: &mut Vec<Group>,
        counts: &mut Counts,
    ) -> Result<(), Skip> {
        let tier = tier_of(rm.medium, rm.locality, rm.secondary)?;
        let (lane, spec) = self.lane(rm.group_idx)?;
        let by_chain = self.by_chain(&spec);
        let map = &mut self.maps[lane as usize];
        let m = tier as usize;
        // (keyspace, still held elsewhere, names) of the run being gathered.
        let mut gone: Option<(u32, bool, Vec<u64>)> = None;
        let flush = |gone: &mut Option<(u32, bool, Vec<u64>)>, out: &mut Vec<Group>| {
            if let Some((ks, elsewhere, hashes)) = gone.take() {
                let event = match elsewhere {
                    true => Event::RemovedFrom { tier, lane, hashes },
                    false => Event::Removed { lane, hashes },
                };
                push(out, ks, event);
            }
        };
        for &h in rm.block_hashes.iter().take(PREFETCH) {
            map.prefetch(h);
        }
        for &h in &rm.block_hashes {
            match map.get_mut(h) {
                Some(e) if e.copies[m] > 0 => {
                    e.copies[m] -= 1;
                    counts.removed[m] += 1;
                    if e.copies[m] > 0 {
                        continue;
                    }
                    let (ks, named, elsewhere) = (e.ks, e.named, held(&e.copies));
                    let name = if by_chain { e.chain } else { h };
                    if !elsewhere {
                        map.remove(h);
                        self.keyspaces.release(ks);
                    }
                    if named {
                        if gone.as_ref().is_some_and(|g| (g.0, g.1) != (ks, elsewhere)) {
                            flush(&mut gone, out);
                        }
                        gone.get_or_insert_with(|| (ks, elsewhere, Vec::new()))
                            .2
                            .push(name);
                    }
                }
                _ => counts.unknown_removals += 1,
            }
        }
        flush(&mut gone, out);
        Ok(())
    }

    /// The translator as plain data.
    pub fn export(&self) -> TranslatorImage {
        TranslatorImage {
            keyspaces: self.keyspaces.keys().cloned().collect(),
            lanes: self
                .maps
                .iter()
                .map(|m| {
                    let entry = |e: &Known| Entry {
                        ks: e.ks,
                        chain: e.chain,
                        end: e.end,
                        copies: e.copies,
                        named: e.named,
                        pending: e.pending.to_vec(),
                    };
                    m.iter().map(|(h, e)| (h, entry(e))).collect()
                })
                .collect(),
        }
    }

    /// Restores an image into a fresh translator of the same roster; false (nothing
    /// restored) when its lanes or keyspaces do not fit, or an entry's pending tokens
    /// could not be (a lane block's worth or more, or more than its end), or it holds no copy.
    pub fn import(&mut self, image: &TranslatorImage) -> bool {
        let fits = image.lanes.len() == self.maps.len()
            && image.lanes.iter().zip(&self.lanes).all(|(entries, lane)| {
                entries.iter().all(|(_, e)| {
                    (e.ks as usize) < image.keyspaces.len()
                        && held(&e.copies)
                        && e.pending.len() < lane.block_tokens as usize
                        && e.pending.len() as u64 <= e.end
                })
            });
        let distinct: std::collections::HashSet<&Keyspace> = image.keyspaces.iter().collect();
        if !fits || distinct.len() < image.keyspaces.len() || self.keyspaces.slots() > 0 {
            return false;
        }
        // Each held while the maps fill (an unused index could be given to the next).
        for k in &image.keyspaces {
            let i = self.intern_key(k);
            self.keyspaces.acquire(i);
        }
        for (map, entries) in self.maps.iter_mut().zip(&image.lanes) {
            // The pages of one lane block (same keyspace, boundary chain and position)
            // share their pending tokens again.
            let mut blocks: HashMap<(u32, u64, u64), Vec<usize>> = HashMap::new();
            for (i, (_, e)) in entries.iter().enumerate() {
                let boundary = e.end - e.pending.len() as u64;
                blocks.entry((e.ks, e.chain, boundary)).or_default().push(i);
            }
            let mut views = vec![Pending::default(); entries.len()];
            for members in blocks.values() {
                let lists: Vec<&[u32]> =
                    members.iter().map(|&i| &entries[i].1.pending[..]).collect();
                for (&i, view) in members.iter().zip(pending::share(&lists)) {
                    views[i] = view;
                }
            }
            *map = entries
                .iter()
                .zip(views)
                .map(|((h, e), pending)| {
                    let known = Known {
                        ks: e.ks,
                        chain: e.chain,
                        end: e.end,
                        copies: e.copies,
                        named: e.named,
                        pending,
                    };
                    (*h, known)
                })
                .collect();
            for (_, e) in map.iter() {
                self.keyspaces.acquire(e.ks);
            }
        }
        for i in 0..image.keyspaces.len() {
            self.keyspaces.release(i as u32);
        }
        true
    }
}

/// Hashes one lane block's tokens (`block`-token keyspace blocks) continuing from
/// `prev`, mixing `keys` into its first keyspace block; appends the hashes and returns
/// the last. The same function as [`chain::token_chain_with_extras`].
fn lane_block(prev: u64, block: u32, tokens: &[u32], keys: &[ExtraKey], out: &mut Vec<u64>) -> u64 {
    let from = out.len();
    chain::chain_tokens(prev, block, &tokens[..block as usize], out);
    let first = chain::mix_extra(out[from], keys);
    out[from] = first;
    chain::chain_tokens(first, block, &tokens[block as usize..], out);
    *out.last().expect("a lane block has a keyspace block")
}

/// Whether an event's kind (and window) describe the roster lane's kind.
fn same_kind(lane: LaneKind, event: LaneKind, window: Option<u32>) -> bool {
    match (lane, event) {
        (LaneKind::SlidingWindow { window: w }, LaneKind::SlidingWindow { .. }) => {
            window.is_none_or(|got| got == w)
        }
        (LaneKind::ChunkedLocal { chunk: c }, LaneKind::ChunkedLocal { .. }) => {
            window.is_none_or(|got| got == c)
        }
        (a, b) => a.name() == b.name(),
    }
}

fn push(out: &mut Vec<Group>, ks: u32, event: Event) {
    match out.last_mut() {
        Some(g) if g.ks == ks => g.events.push(event),
        _ => out.push(Group {
            ks,
            events: vec![event],
        }),
    }
}

/// Cuts `events` into steps of about `blocks` engine blocks each (at least one), in
/// order, so that a huge batch is translated a step at a time and queries run between
/// steps. A longer store is cut into stores that continue each other (each names the
/// last block of the one before as its parent), which the translator takes as it takes
/// the whole store, except that a skip is counted once per cut (an unknown parent
/// skips every cut); a store with extra keys or a malformed one is left whole. A long
/// removal is cut likewise.
pub fn steps(events: Vec<EngineEvent>, blocks: usize) -> Vec<Vec<EngineEvent>> {
    let blocks = blocks.max(1);
    // Most batches are one step: taken as they are, not moved event by event.
    if !events.is_empty() && events.iter().map(weight).sum::<usize>() <= blocks {
        return vec![events];
    }
    let (mut out, mut step, mut filled) = (Vec::new(), Vec::new(), 0);
    for mut ev in events {
        loop {
            let room = blocks - filled;
            let rest = match &mut ev {
                EngineEvent::Stored(st) if st.block_hashes.len() > room && cuttable(st) => {
                    Some(EngineEvent::Stored(cut_store(st, room)))
                }
                EngineEvent::Removed(rm) if rm.block_hashes.len() > room => {
                    Some(EngineEvent::Removed(Removed {
                        block_hashes: rm.block_hashes.split_off(room),
                        ..rm.clone()
                    }))
                }
                _ => None,
            };
            filled += weight(&ev);
            step.push(ev);
            if filled >= blocks {
                out.push(std::mem::take(&mut step));
                filled = 0;
            }
            match rest {
                Some(r) => ev = r,
                None => break,
            }
        }
    }
    if !step.is_empty() {
        out.push(step);
    }
    out
}

/// What an event counts for in a step: its blocks, at least one.
fn weight(ev: &EngineEvent) -> usize {
    match ev {
        EngineEvent::Stored(st) => st.block_hashes.len().max(1),
        EngineEvent::Removed(rm) => rm.block_hashes.len().max(1),
        EngineEvent::Cleared | EngineEvent::Unknown(_) => 1,
    }
}

/// Whether a store can be cut: well formed, without extra keys, not a placeholder.
fn cuttable(st: &Stored) -> bool {
    st.extras.iter().all(|k| k.is_empty())
        && !st.is_placeholder()
        && st.token_ids.len() == st.block_hashes.len() * st.block_size as usize
}

/// Leaves the first `keep` blocks (at least one) in `st`; returns the store of the rest,
/// continuing it.
fn cut_store(st: &mut Stored, keep: usize) -> Stored {
    let keep = keep.max(1);
    Stored {
        block_hashes: st.block_hashes.split_off(keep),
        parent: Some(st.block_hashes[keep - 1]),
        token_ids: st.token_ids.split_off(keep * st.block_size as usize),
        block_size: st.block_size,
        lora_id: st.lora_id,
        medium: st.medium,
        lora_name: st.lora_name.clone(),
        extras: Vec::new(),
        cache_salt: st.cache_salt.clone(),
        group_idx: st.group_idx,
        spec_kind: st.spec_kind.clone(),
        sliding_window: st.sliding_window,
        locality: st.locality,
        secondary: st.secondary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvix_wire::chain::token_chain;

    const KB: u32 = 16;

    fn st(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> Stored {
        Stored::plain(hashes.to_vec(), parent, tokens.collect(), 32)
    }

    fn batch(events: Vec<EngineEvent>) -> Batch {
        Batch {
            ts: 0.0,
            events,
            dp_rank: 0,
        }
    }

    fn run(t: &mut Translator, events: Vec<EngineEvent>) -> (Vec<Group>, Counts) {
        let (mut out, mut c) = (Vec::new(), Counts::default());
        t.apply(&batch(events), &mut out, &mut c);
        (out, c)
    }

    fn stored_of(g: &[Group]) -> Vec<(u32, Vec<u64>, Vec<u64>)> {
        g.iter()
            .flat_map(|g| &g.events)
            .filter_map(|e| match e {
                Event::Stored {
                    start,
                    chain,
                    engine,
                    ..
                } => Some((*start, chain.clone(), engine.clone())),
                _ => None,
            })
            .collect()
    }

    fn ks(salt: &str) -> Keyspace {
        Keyspace {
            salt: salt.into(),
            ..Keyspace::tokens("m")
        }
    }

    #[test]
    fn stores_rehash_tokens_and_parents_resolve_position_and_seed() {
        let mut t = Translator::new(KB, "m", "s", &[Lane::full(32)]);
        let whole = token_chain(ks("s").seed(KB), KB, &(0..128).collect::<Vec<_>>());
        let (out, _) = run(
            &mut t,
            vec![EngineEvent::Stored(st(&[10, 11], None, 0..64))],
        );
        assert_eq!(*t.keyspace(out[0].ks), ks("s"));
        assert_eq!(
            out[0].events,
            vec![Event::Stored {
                lane: 0,
                start: 0,
                parent: None,
                chain: whole[..4].to_vec(),
                engine: vec![10, 11]
            }]
        );
        let (out, _) = run(
            &mut t,
            vec![EngineEvent::Stored(st(&[12, 13], Some(11), 64..128))],
        );
        let Event::Stored {
            start,
            chain,
            parent,
            ..
        } = &out[0].events[0]
        else {
            panic!()
        };
        assert_eq!(
            (*start, &chain[..], *parent),
            (4, &whole[4..], Some(whole[3]))
        );
        // Mid-chain parent too.
        let (out, _) = run(
            &mut t,
            vec![EngineEvent::Stored(st(&[20], Some(10), 32..64))],
        );
        assert_eq!(stored_of(&out), vec![(2, whole[2..4].to_vec(), vec![20])]);
    }

    #[test]
    fn unknown_parents_wrong_lanes_kinds_and_bad_stores_are_skipped_and_counted() {
        let lanes = [
            Lane::full(32),
            Lane {
                kind: LaneKind::SlidingWindow { window: 64 },
                block_tokens: 32,
            },
        ];
        let mut t = Translator::new(KB, "m", "", &lanes);
        let mut swa = st(&[1], None, 0..32);
        swa.group_idx = 1;
        swa.spec_kind = Some("sliding_window".into());
        swa.sliding_window = Some(64);
        let mut swa_mla = swa.clone();
        swa_mla.spec_kind = Some("sliding_window_mla".into());
        let mut wrong_window = swa.clone();
        wrong_window.sliding_window = Some(128);
        let mut wrong_kind = st(&[2], None, 0..32);
        wrong_kind.spec_kind = Some("mamba".into());
        let mut cross = st(&[2], None, 0..32);
        cross.spec_kind = Some("cross_attention".into());
        let mut too_big = st(&[3], None, 0..64);
        too_big.block_size = 64;
        let mut no_group = st(&[4], None, 0..32);
        no_group.group_idx = 2;
        let mut sink = st(&[7], None, 0..32);
        sink.spec_kind = Some("sink_full_attention".into());
        let (out, c) = run(
            &mut t,
            vec![
                EngineEvent::Stored(swa),
                EngineEvent::Stored(swa_mla),
                EngineEvent::Stored(sink),
                EngineEvent::Stored(wrong_window),
                EngineEvent::Stored(wrong_kind),
                EngineEvent::Stored(cross),
                EngineEvent::Stored(too_big),
                EngineEvent::Stored(no_group),
                EngineEvent::Stored(st(&[5], Some(99), 0..32)),
                EngineEvent::Stored(st(&[6], None, 0..31)),
                EngineEvent::Unknown("X".into()),
            ],
        );
        assert_eq!(stored_of(&out).len(), 3);
        assert_eq!(c.skipped, [1, 4, 1, 1, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(c.stored, [3, 0, 0]);
    }

    #[test]
    fn a_block_leaves_each_tier_and_its_names_with_the_last() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let mut cpu = st(&[7], None, 0..32);
        cpu.medium = Medium::Cpu;
        let (out, _) = run(
            &mut t,
            vec![
                EngineEvent::Stored(st(&[7], None, 0..32)),
                EngineEvent::Stored(cpu),
            ],
        );
        assert!(matches!(
            out[0].events[..],
            [
                Event::Stored { .. },
                Event::StoredIn {
                    tier: Tier::Cpu,
                    ..
                }
            ]
        ));
        let rm = |m| EngineEvent::Removed(Removed::new(vec![7], m, 0));
        let (out, c) = run(&mut t, vec![rm(Medium::Gpu)]);
        assert_eq!(
            out[0].events,
            vec![Event::RemovedFrom {
                tier: Tier::Gpu,
                lane: 0,
                hashes: vec![7]
            }],
            "the CPU copy still holds it: its name stays"
        );
        assert_eq!(c.removed, [1, 0, 0]);
        let (out, _) = run(&mut t, vec![rm(Medium::Cpu)]);
        assert_eq!(
            out[0].events,
            vec![Event::Removed {
                lane: 0,
                hashes: vec![7]
            }]
        );
        let (out, c) = run(&mut t, vec![rm(Medium::Cpu)]);
        assert!(out.is_empty());
        assert_eq!(c.unknown_removals, 1);
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn a_placeholder_copies_a_known_block_and_an_unknown_one_is_counted() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(KB)]);
        let mut three = st(&[1, 2, 3], None, 0..48);
        three.block_size = KB;
        let (out, _) = run(&mut t, vec![EngineEvent::Stored(three)]);
        let Event::Stored { chain, .. } = &out[0].events[0] else {
            panic!("{out:?}")
        };
        let chain = chain.clone();
        // vLLM's legacy offloading store: one hash, no parent, no tokens, block size 0.
        let placeholder = |hashes: &[u64], medium| {
            let mut p = Stored::plain(hashes.to_vec(), None, vec![], 0);
            p.medium = medium;
            EngineEvent::Stored(p)
        };
        let (out, c) = run(
            &mut t,
            vec![
                placeholder(&[2, 3], Medium::Cpu),
                placeholder(&[99], Medium::Storage),
            ],
        );
        assert_eq!(
            out[0].events,
            vec![Event::StoredIn {
                tier: Tier::Cpu,
                lane: 0,
                start: 1,
                parent: None,
                chain: chain[1..].to_vec(),
                engine: vec![],
            }]
        );
        assert_eq!(c.stored, [0, 2, 0]);
        assert_eq!(c.skipped[Skip::UnknownPlaceholder as usize], 1);
        // Its removal leaves the GPU copy: the block left CPU only.
        let (out, _) = run(
            &mut t,
            vec![EngineEvent::Removed(Removed::new(vec![3], Medium::Cpu, 0))],
        );
        assert_eq!(
            out[0].events,
            vec![Event::RemovedFrom {
                tier: Tier::Cpu,
                lane: 0,
                hashes: vec![chain[2]]
            }]
        );
        // On a lane of engine blocks wider than the keyspace block, a placeholder's
        // position is not known: counted, not guessed.
        let mut wide = Translator::new(KB, "m", "", &[Lane::full(32)]);
        run(&mut wide, vec![EngineEvent::Stored(st(&[1], None, 0..32))]);
        let (out, c) = run(&mut wide, vec![placeholder(&[1], Medium::Cpu)]);
        assert!(out.is_empty());
        assert_eq!(c.skipped[Skip::PlaceholderCoarseLane as usize], 1);
    }

    #[test]
    fn remote_secondary_and_unknown_media_are_counted_and_dropped() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(KB)]);
        let mut remote = st(&[1], None, 0..16);
        remote.locality = Locality::Remote;
        let mut odd = st(&[2], None, 0..16);
        odd.locality = Locality::Unknown;
        let mut secondary = st(&[3], None, 0..16);
        secondary.secondary = true;
        let mut fs = st(&[4], None, 0..16);
        fs.medium = Medium::Unknown;
        let events = [remote, odd, secondary, fs]
            .map(EngineEvent::Stored)
            .to_vec();
        let (out, c) = run(&mut t, events);
        assert!(out.is_empty());
        assert_eq!(c.skipped[Skip::NotLocal as usize], 2);
        assert_eq!(c.skipped[Skip::SecondaryTier as usize], 1);
        assert_eq!(c.skipped[Skip::UnknownMedium as usize], 1);
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn a_hash_in_two_physical_blocks_is_held_until_both_go() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let twice = || EngineEvent::Stored(st(&[7], None, 0..32));
        let (out, _) = run(&mut t, vec![twice(), twice()]);
        assert_eq!(stored_of(&out).len(), 2, "each store is forwarded");
        // Across a snapshot too: the copies are part of the image.
        let mut back = Translator::new(KB, "m", "", &[Lane::full(32)]);
        assert!(back.import(&t.export()));
        for t in [&mut t, &mut back] {
            let (out, c) = run(t, vec![gone(&[7])]);
            assert!(out.is_empty(), "the other copy still holds it");
            assert_eq!(c.removed, [1, 0, 0]);
            let (out, _) = run(t, vec![gone(&[7])]);
            assert_eq!(
                out[0].events,
                vec![Event::Removed {
                    lane: 0,
                    hashes: vec![7]
                }]
            );
            let (_, c) = run(t, vec![gone(&[7])]);
            assert_eq!(c.unknown_removals, 1);
            assert_eq!(t.tracked(), 0);
        }
    }

    fn salted(hash: u64, salt: &str) -> EngineEvent {
        let mut s = st(&[hash], None, 0..32);
        s.cache_salt = Some(salt.into());
        EngineEvent::Stored(s)
    }

    fn gone(hashes: &[u64]) -> EngineEvent {
        EngineEvent::Removed(Removed::new(hashes.to_vec(), Medium::Gpu, 0))
    }

    #[test]
    fn one_block_lanes_name_blocks_by_chain_hash_each_under_its_own_keyspace() {
        // vLLM's shape: 16-token blocks, one keyspace block each.
        let mut t = Translator::new(KB, "m", "", &[Lane::full(16)]);
        let mut a = st(&[1, 2], None, 0..32);
        a.block_size = 16;
        a.cache_salt = Some("a".into());
        let mut b = st(&[3], None, 100..116);
        b.block_size = 16;
        let (out, _) = run(&mut t, vec![EngineEvent::Stored(a), EngineEvent::Stored(b)]);
        let chain_a = token_chain(ks("a").seed(KB), KB, &(0..32).collect::<Vec<_>>());
        let chain_b = token_chain(ks("").seed(KB), KB, &(100..116).collect::<Vec<_>>());
        // (start, chain, engine hashes): none are sent.
        assert_eq!(
            stored_of(&out),
            vec![(0, chain_a.clone(), vec![]), (0, chain_b.clone(), vec![])]
        );
        // One removal naming blocks of both keyspaces: each under the keyspace that
        // stored it, by its chain hash.
        let (out, _) = run(&mut t, vec![gone(&[3, 2])]);
        let removed: Vec<(u64, Vec<Event>)> = (out.iter())
            .map(|g| (t.seed(g.ks), g.events.clone()))
            .collect();
        let rm = |hashes: Vec<u64>| vec![Event::Removed { lane: 0, hashes }];
        assert_eq!(
            removed,
            vec![
                (ks("").seed(KB), rm(vec![chain_b[0]])),
                (ks("a").seed(KB), rm(vec![chain_a[1]]))
            ]
        );
    }

    #[test]
    fn a_salt_per_request_keeps_as_many_keyspaces_as_hold_blocks() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        for r in 0..1000u64 {
            let salt = format!("user-{r}");
            let (out, _) = run(&mut t, vec![salted(r, &salt)]);
            assert_eq!(t.seed(out[0].ks), ks(&salt).seed(KB));
            if r >= 2 {
                run(&mut t, vec![gone(&[r - 2])]);
            }
        }
        assert_eq!(t.tracked(), 2);
        assert!(
            t.keyspace_slots() <= 4,
            "{} keyspace indexes for 2 held",
            t.keyspace_slots()
        );
        // Clears and restores forget keyspaces too.
        run(&mut t, vec![EngineEvent::Cleared, salted(5000, "last")]);
        let mut back = Translator::new(KB, "m", "", &[Lane::full(32)]);
        assert!(back.import(&t.export()));
        let (out, _) = run(&mut back, vec![gone(&[5000])]);
        assert_eq!(back.seed(out[0].ks), ks("last").seed(KB));
    }

    #[test]
    fn a_keyspace_emptied_in_a_batch_keeps_its_groups_meaning_until_the_next() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        run(&mut t, vec![salted(1, "a")]);
        // The removal empties "a"; the store after it in the same batch brings a new
        // keyspace, which must not take the index the removal's group names.
        let (out, _) = run(&mut t, vec![gone(&[1]), salted(2, "b")]);
        let seeds: Vec<u64> = out.iter().map(|g| t.seed(g.ks)).collect();
        assert_eq!(seeds, vec![ks("a").seed(KB), ks("b").seed(KB)]);
        assert_eq!(*t.keyspace(out[0].ks), ks("a"));
    }

    #[test]
    fn lora_names_and_salts_pick_the_keyspace_and_continuations_inherit_it() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let mut lora = st(&[8], None, 0..32);
        lora.lora_name = Some("ad".into());
        let mut by_id = st(&[9], None, 0..32);
        by_id.lora_id = Some(3);
        let (out, c) = run(
            &mut t,
            vec![
                EngineEvent::Stored(lora),
                EngineEvent::Stored(by_id),
                salted(30, "tenant"),
                EngineEvent::Stored(st(&[31], Some(30), 32..64)),
            ],
        );
        assert_eq!(c.salted, 1);
        assert_eq!(out.len(), 3);
        assert_eq!(t.keyspace(out[0].ks).lora, "ad");
        assert_eq!(t.keyspace(out[1].ks).lora, "lora-id:3");
        assert_eq!(*t.keyspace(out[2].ks), ks("tenant"));
        assert_eq!(
            out[2].events.len(),
            2,
            "the continuation is filed under the salt"
        );
        let salted_chain = token_chain(ks("tenant").seed(KB), KB, &(0..64).collect::<Vec<_>>());
        assert_eq!(
            stored_of(&out[2..]),
            vec![
                (0, salted_chain[..2].to_vec(), vec![30]),
                (2, salted_chain[2..].to_vec(), vec![31])
            ]
        );
        // One removal naming blocks of three keyspaces: each run filed under its own.
        let (out, c) = run(&mut t, vec![gone(&[30, 31, 8, 99, 9])]);
        assert_eq!(c.unknown_removals, 1);
        let filed: Vec<(String, Vec<Event>)> = out
            .iter()
            .map(|g| {
                (
                    t.keyspace(g.ks).lora.clone() + "/" + &t.keyspace(g.ks).salt,
                    g.events.clone(),
                )
            })
            .collect();
        let removed = |hashes: Vec<u64>| vec![Event::Removed { lane: 0, hashes }];
        assert_eq!(
            filed,
            vec![
                ("/tenant".to_string(), removed(vec![30, 31])),
                ("ad/".to_string(), removed(vec![8])),
                ("lora-id:3/".to_string(), removed(vec![9])),
            ]
        );
        let (out, _) = run(&mut t, vec![EngineEvent::Cleared]);
        assert_eq!(out[0].events, vec![Event::Cleared]);
        assert_eq!(t.tracked(), 0);
    }

    #[test]
    fn extra_keys_change_the_chain_from_their_block_on_as_the_wire_function_does() {
        let mut t = Translator::new(KB, "m", "", &[Lane::full(32)]);
        let image = vec![ExtraKey::Multimodal {
            identifier: "img".into(),
            offset: 3,
        }];
        let mut keyed = st(&[1, 2, 3], None, 0..96);
        keyed.extras = vec![vec![], image.clone(), vec![]];
        let (out, c) = run(&mut t, vec![EngineEvent::Stored(keyed)]);
        assert_eq!(c.extra_keys, 1);
        let tokens: Vec<u32> = (0..96).collect();
        let want = chain::token_chain_with_extras(
            ks("").seed(KB),
            KB,
            32,
            &tokens,
            &[vec![], image, vec![]],
        );
        let plain = token_chain(ks("").seed(KB), KB, &tokens);
        let got = &stored_of(&out)[0].1;
        assert_eq!(got, &want);
        assert_eq!(got[..2], plain[..2]);
        assert!(got[2..].iter().zip(&plain[2..]).all(|(a, b)| a != b));
    }

    #[test]
    fn pages_accumulate_into_lane_blocks_named_by_the_completing_page() {
        // SGLang page size 1 under a 16-token lane: token-by-token stores.
        let mut t = Translator::new(KB, "m", "", &[Lane::full(16)]);
        let tokens: Vec<u32> = (100..140).collect();
        let mut all = Vec::new();
        let mut parent = None;
        for (i, &tok) in tokens.iter().enumerate() {
            let mut page = st(&[1000 + i as u64], parent, 0..0);
            page.token_ids = vec![tok];
            page.block_size = 1;
            let (out, _) = run(&mut t, vec![EngineEvent::Stored(page)]);
            all.extend(stored_of(&out));
            parent = Some(1000 + i as u64);
        }
        let want = token_chain(ks("").seed(KB), KB, &tokens);
        // A lane block of one keyspace block is named by its chain hash alone.
        assert_eq!(
            all,
            vec![(0, vec![want[0]], vec![]), (1, vec![want[1]], vec![])]
        );
        // A partial last page of 5 tokens, then its continuation, is the same chain.
        let mut t = Translator::new(KB, "m", "", &[Lane::full(16)]);
        let mut a = st(&[1, 2], None, 0..0);
        a.token_ids = tokens[..32].to_vec();
        a.block_size = 16;
        let mut partial = st(&[3], Some(2), 0..0);
        partial.token_ids = tokens[32..37].to_vec();
        partial.block_size = 5;
        let mut rest = st(&[4], Some(3), 0..0);
        rest.token_ids = tokens[37..40].to_vec();
        rest.block_size = 3;
        let (out, _) = run(
            &mut t,
            vec![
                EngineEvent::Stored(a),
                EngineEvent::Stored(partial),
                EngineEvent::Stored(rest),
            ],
        );
        assert_eq!(stored_of(&out), vec![(0, want.clone(), vec![])]);
        // Removing a page that completed nothing names nothing; removing the page that
        // completed a block names that block's chain hash.
        let (out, _) = run(&mut t, vec![gone(&[4]), gone(&[3])]);
        assert!(out.is_empty());
        let (out, _) = run(&mut t, vec![gone(&[2])]);
        assert_eq!(
            out[0].events,
            vec![Event::Removed {
                lane: 0,
                hashes: vec![want[1]]
            }]
        );
    }

    /// SGLang's one-token pages under a wide lane: every page remembers the tokens since
    /// the boundary, and they must share one buffer (a copy each is quadratic).
    #[test]
    fn one_token_pages_under_a_wide_lane_share_their_pending_tokens() {
        const L: u32 = 1024;
        let lanes = [Lane::full(L)];
        let mut t = Translator::new(KB, "m", "", &lanes);
        let page = |i: u32| {
            let mut s = st(
                &[100 + i as u64],
                (i > 0).then(|| 100 + i as u64 - 1),
                i..i + 1,
            );
            s.block_size = 1;
            EngineEvent::Stored(s)
        };
        for i in 0..L - 1 {
            let (out, c) = run(&mut t, vec![page(i)]);
            assert!(
                out.is_empty() && c.skipped.iter().all(|&n| n == 0),
                "page {i}"
            );
        }
        let first = t.maps[0].get(100).unwrap().pending.clone();
        assert!(t.maps[0].iter().all(|(_, k)| k.pending.shares(&first)));
        assert_eq!(
            t.maps[0].get(100 + 500).unwrap().pending.to_vec(),
            (0..501).collect::<Vec<_>>()
        );
        // Restored, they share again, and the last page completes the same lane block.
        let mut back = Translator::new(KB, "m", "", &lanes);
        assert!(back.import(&t.export()));
        let first = back.maps[0].get(100).unwrap().pending.clone();
        assert!(back.maps[0].iter().all(|(_, k)| k.pending.shares(&first)));
        let whole = token_chain(ks("").seed(KB), KB, &(0..L).collect::<Vec<_>>());
        for tr in [&mut t, &mut back] {
            let (out, _) = run(tr, vec![page(L - 1)]);
            assert_eq!(
                stored_of(&out),
                vec![(0, whole.clone(), vec![100 + L as u64 - 1])]
            );
        }
    }

    #[test]
    fn an_image_whose_pending_tokens_cannot_be_is_refused() {
        let lanes = [Lane::full(32)];
        let entry = |end: u64, pending: Vec<u32>| Entry {
            ks: 0,
            chain: 1,
            end,
            copies: [1, 0, 0],
            named: false,
            pending,
        };
        for bad in [entry(1, vec![1, 2]), entry(64, vec![0; 32])] {
            let image = TranslatorImage {
                keyspaces: vec![ks("")],
                lanes: vec![vec![(5, bad.clone())]],
            };
            assert!(
                !Translator::new(KB, "m", "", &lanes).import(&image),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn export_and_import_continue_where_they_left_off() {
        let lanes = [Lane::full(16)];
        let mut t = Translator::new(KB, "m", "x", &lanes);
        let mut page = st(&[1], None, 0..0);
        page.token_ids = (0..10).collect();
        page.block_size = 10;
        run(&mut t, vec![EngineEvent::Stored(page)]);
        let mut back = Translator::new(KB, "m", "x", &lanes);
        assert!(back.import(&t.export()));
        let mut next = st(&[2], Some(1), 0..0);
        next.token_ids = (10..16).collect();
        next.block_size = 6;
        let (a, _) = run(&mut t, vec![EngineEvent::Stored(next.clone())]);
        let (b, _) = run(&mut back, vec![EngineEvent::Stored(next)]);
        assert_eq!(stored_of(&a), stored_of(&b));
        assert_eq!(stored_of(&a).len(), 1);
        assert!(
            !Translator::new(KB, "m", "x", &[Lane::full(16), Lane::full(16)]).import(&t.export())
        );
    }

    /// What the index holds after `groups`, as a set of (keyspace seed, lane, tier,
    /// chain hash): a model of the feed that is blind to how stores were cut.
    fn fold(
        t: &Translator,
        groups: &[Group],
        held: &mut std::collections::BTreeSet<(u64, u8, Tier, u64)>,
    ) {
        for g in groups {
            let seed = t.seed(g.ks);
            for e in &g.events {
                match e {
                    Event::Stored { lane, chain, .. } => {
                        held.extend(chain.iter().map(|&h| (seed, *lane, Tier::Gpu, h)));
                    }
                    Event::StoredIn {
                        tier, lane, chain, ..
                    } => {
                        held.extend(chain.iter().map(|&h| (seed, *lane, *tier, h)));
                    }
                    Event::Removed { lane, hashes } => {
                        for h in hashes {
                            for tier in Tier::ALL {
                                held.remove(&(seed, *lane, tier, *h));
                            }
                        }
                    }
                    Event::RemovedFrom { tier, lane, hashes } => {
                        for h in hashes {
                            held.remove(&(seed, *lane, *tier, *h));
                        }
                    }
                    Event::Cleared => held.clear(),
                }
            }
        }
    }

    proptest::proptest! {
        /// Translated a step at a time ([`steps`]), batches of long stores (pages of 16
        /// and 32 tokens into a 32-token lane), removals and clears leave the translator
        /// and the index as translating them whole does.
        #[test]
        fn batches_cut_into_steps_translate_as_whole_ones(
            ops in proptest::collection::vec((0u8..12, 1usize..40, proptest::prelude::any::<u64>()), 1..40),
            page in proptest::sample::select(vec![16u32, 32]),
            step in 1usize..9,
        ) {
            let (mut whole, mut cut) = (
                Translator::new(KB, "m", "", &[Lane::full(32)]),
                Translator::new(KB, "m", "", &[Lane::full(32)]),
            );
            let (mut held_whole, mut held_cut) = (Default::default(), Default::default());
            let (mut stored, mut next, mut token) = (Vec::<u64>::new(), 1u64, 0u32);
            let mut batch = Vec::new();
            for (i, &(kind, n, pick)) in ops.iter().enumerate() {
                match kind {
                    0 => batch.push(EngineEvent::Cleared),
                    1 | 2 if !stored.is_empty() => {
                        let k = (pick as usize % stored.len()).min(n);
                        let gone: Vec<u64> = stored.drain(..k).collect();
                        batch.push(EngineEvent::Removed(Removed::new(gone, Medium::Gpu, 0)));
                    }
                    // Copies on CPU (placeholders), and their removal.
                    3 | 4 if !stored.is_empty() => {
                        let at = pick as usize % stored.len();
                        let some: Vec<u64> = stored.iter().skip(at).take(n).copied().collect();
                        batch.push(match kind {
                            3 => {
                                let mut copy = Stored::plain(some, None, vec![], 0);
                                copy.medium = Medium::Cpu;
                                EngineEvent::Stored(copy)
                            }
                            _ => EngineEvent::Removed(Removed::new(some, Medium::Cpu, 0)),
                        });
                    }
                    _ => {
                        let parent = (pick % 3 != 0).then(|| stored.last().copied()).flatten();
                        let hashes: Vec<u64> = (next..next + n as u64).collect();
                        next += n as u64;
                        let tokens = token..token + n as u32 * page;
                        token = tokens.end;
                        stored.extend(&hashes);
                        batch.push(EngineEvent::Stored(Stored::plain(hashes, parent, tokens.collect(), page)));
                    }
                }
                if i % 7 == 6 || i == ops.len() - 1 {
                    let events = std::mem::take(&mut batch);
                    let (mut out, mut counts) = (Vec::new(), Counts::default());
                    whole.apply_events(&events, &mut out, &mut counts);
                    fold(&whole, &out, &mut held_whole);
                    let mut cut_counts = Counts::default();
                    for events in steps(events, step) {
                        let mut out = Vec::new();
                        cut.apply_events(&events, &mut out, &mut cut_counts);
                        fold(&cut, &out, &mut held_cut);
                    }
                    proptest::prop_assert_eq!(&held_whole, &held_cut);
                    proptest::prop_assert_eq!(
                        (counts.stored, counts.removed, counts.unknown_removals),
                        (cut_counts.stored, cut_counts.removed, cut_counts.unknown_removals)
                    );
                    // The same entries (in map order, which the maps' sizes change).
                    let sorted = |t: &Translator| {
                        let mut image = t.export();
                        image.lanes.iter_mut().for_each(|l| l.sort_unstable_by_key(|e| e.0));
                        image
                    };
                    proptest::prop_assert_eq!(sorted(&whole), sorted(&cut));
                }
            }
        }
    }

    #[test]
    fn steps_hold_about_the_blocks_asked_and_cut_long_stores_into_continuations() {
        let long = Stored::plain((1..=10).collect(), Some(99), (0..320).collect(), 32);
        let rm = Removed::new((1..=5).collect(), Medium::Gpu, 0);
        let cut = steps(vec![EngineEvent::Stored(long), EngineEvent::Removed(rm)], 4);
        let sizes: Vec<Vec<usize>> = cut
            .iter()
            .map(|s| {
                s.iter()
                    .map(|e| match e {
                        EngineEvent::Stored(st) => st.block_hashes.len(),
                        EngineEvent::Removed(rm) => rm.block_hashes.len(),
                        _ => 1,
                    })
                    .collect()
            })
            .collect();
        assert_eq!(sizes, [vec![4], vec![4], vec![2, 2], vec![3]]);
        let EngineEvent::Stored(third) = &cut[2][0] else {
            panic!("{cut:?}")
        };
        assert_eq!((third.parent, third.token_ids[0]), (Some(8), 256));
    }
}
