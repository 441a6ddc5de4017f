//! Dynamo's instances as kvix workers. One data-parallel rank of an instance registered
//! through the HTTP API is the worker named
//! `dynamo:{instance}:dp{rank}:{group length}:{routing group}:{model}`: every executor
//! reads the partitions (model, routing group) back from its own roster, so the view
//! lives as long as the roster does, across restarts, snapshots and replicas.

use std::collections::HashMap;

use kvix_engine::Roster;
use kvix_wire::WorkerId;

/// One rank of an instance, as a worker's name says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rank {
    pub instance: u64,
    pub rank: u32,
    pub group: String,
    pub model: String,
}

const PREFIX: &str = "dynamo:";

impl Rank {
    /// The worker name of this rank.
    pub fn name(&self) -> String {
        format!(
            "{PREFIX}{}:dp{}:{}:{}:{}",
            self.instance,
            self.rank,
            self.group.len(),
            self.group,
            self.model
        )
    }

    /// The rank a worker name stands for; None for other workers.
    pub fn parse(name: &str) -> Option<Rank> {
        let rest = name.strip_prefix(PREFIX)?;
        let (instance, rest) = rest.split_once(':')?;
        let (rank, rest) = rest.strip_prefix("dp")?.split_once(':')?;
        let (len, rest) = rest.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let group = rest.get(..len)?;
        let model = rest.get(len..)?.strip_prefix(':')?;
        Some(Rank {
            instance: instance.parse().ok()?,
            rank: rank.parse().ok()?,
            group: group.to_string(),
            model: model.to_string(),
        })
    }
}

/// A partition's member: a registered rank and its worker id on this executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub worker: WorkerId,
    pub instance: u64,
    pub rank: u32,
}

/// The partitions of one executor's roster, rebuilt when the roster changes.
#[derive(Debug, Default)]
pub struct View {
    seen: Option<u64>,
    /// (model, routing group) → its ranks, by instance then rank.
    partitions: HashMap<(String, String), Vec<Member>>,
    /// Instance → the partition it is registered in.
    instances: HashMap<u64, (String, String)>,
    /// Worker id → (instance, rank).
    of_worker: HashMap<WorkerId, (u64, u32)>,
}

impl View {
    /// Brings the view up to `roster`'s installs and removals.
    pub fn refresh(&mut self, roster: &Roster) {
        if self.seen == Some(roster.changes()) {
            return;
        }
        self.partitions.clear();
        self.instances.clear();
        self.of_worker.clear();
        for entry in roster.iter() {
            let Some(r) = Rank::parse(&entry.name) else {
                continue;
            };
            let key = (r.model, r.group);
            self.instances.insert(r.instance, key.clone());
            self.of_worker.insert(entry.id, (r.instance, r.rank));
            self.partitions.entry(key).or_default().push(Member {
                worker: entry.id,
                instance: r.instance,
                rank: r.rank,
            });
        }
        for members in self.partitions.values_mut() {
            members.sort_by_key(|m| (m.instance, m.rank));
        }
        self.seen = Some(roster.changes());
    }

    /// The ranks registered for `model` in `group`; None when there are none (Dynamo
    /// answers 404: no indexer for that partition).
    pub fn partition(&self, model: &str, group: &str) -> Option<&[Member]> {
        self.partitions
            .get(&(model.to_string(), group.to_string()))
            .map(Vec::as_slice)
    }

    /// The (model, routing group) an instance is registered in.
    pub fn instance(&self, instance: u64) -> Option<(&str, &str)> {
        self.instances
            .get(&instance)
            .map(|(m, g)| (m.as_str(), g.as_str()))
    }

    /// The registered ranks of `instance`.
    pub fn ranks(&self, instance: u64) -> Vec<Member> {
        self.instance(instance)
            .and_then(|(m, g)| self.partition(m, g))
            .map(|ms| {
                ms.iter()
                    .filter(|m| m.instance == instance)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The instance and rank a worker stands for.
    pub fn rank_of(&self, worker: WorkerId) -> Option<(u64, u32)> {
        self.of_worker.get(&worker).copied()
    }

    /// Every partition, in no order.
    pub fn partitions(&self) -> impl Iterator<Item = (&(String, String), &[Member])> {
        self.partitions.iter().map(|(k, v)| (k, v.as_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_read_back_whatever_the_group_and_model_hold() {
        let r = Rank {
            instance: 7,
            rank: 1,
            group: "a:b".into(),
            model: "meta-llama/Llama-3.1-8B:v2".into(),
        };
        assert_eq!(r.name(), "dynamo:7:dp1:3:a:b:meta-llama/Llama-3.1-8B:v2");
        assert_eq!(Rank::parse(&r.name()), Some(r));
        for other in [
            "w1",
            "dynamo:x:dp0:0::m",
            "dynamo:1:dp0:9:short:m",
            "dynamo:1:0:0::m",
        ] {
            assert_eq!(Rank::parse(other), None, "{other}");
        }
    }

    proptest! {
        #[test]
        fn any_rank_reads_back(instance in any::<u64>(), rank in any::<u32>(), group in ".{0,12}", model in ".{0,24}") {
            let r = Rank { instance, rank, group, model };
            prop_assert_eq!(Rank::parse(&r.name()), Some(r));
        }
    }
}
