package kvix

import (
	"sync/atomic"
	"time"
)

type counters struct {
	outcomes         [5]atomic.Uint64
	latencyNs        atomic.Uint64
	hedges           atomic.Uint64
	connects         atomic.Uint64
	connectFailures  atomic.Uint64
	placementDrops   atomic.Uint64
	unknownWorkers   atomic.Uint64
	reuseDrops       atomic.Uint64
	reuseUnreported  atomic.Uint64
	writesRefused    atomic.Uint64
	announcesRefused atomic.Uint64
	malformed        atomic.Uint64
	staleAnswers     atomic.Uint64
}

func (c *counters) record(r Reason, took time.Duration) {
	c.outcomes[r].Add(1)
	c.latencyNs.Add(uint64(took))
}

// Counters is a snapshot of what a Client counted since it started.
type Counters struct {
	Outcomes         map[Reason]uint64 // queries by outcome
	QueryTime        time.Duration     // summed over every query
	Hedges           uint64            // queries sent to a second server
	Connects         uint64            // connections made (the first ones, then reconnects)
	ConnectFailures  uint64            // attempts that failed (dial, handshake, re-announce)
	PlacementDrops   uint64            // placements dropped: queue full or connection lost
	UnknownWorkers   uint64            // placements for a worker no server knows
	ReuseDrops       uint64            // reuse reports dropped
	ReuseUnreported  uint64            // responses without a cached-tokens figure
	WritesRefused    uint64            // placements and reports the server refused
	AnnouncesRefused uint64            // re-announces at a connect the server refused
	Malformed        uint64            // replies of the wrong kind
	StaleAnswers     uint64            // answers of a replica behind its log; the query went on to the next server
}

// FailedOpen is the queries answered without scores for a reason other than an empty index.
func (c Counters) FailedOpen() uint64 {
	return c.Outcomes[ReasonTimeout] + c.Outcomes[ReasonDisconnected] + c.Outcomes[ReasonRejected]
}

// Counters snapshots what the client counted.
func (c *Client) Counters() Counters {
	n := &c.counters
	out := Counters{Outcomes: map[Reason]uint64{}, QueryTime: time.Duration(n.latencyNs.Load()),
		Hedges: n.hedges.Load(), Connects: n.connects.Load(), ConnectFailures: n.connectFailures.Load(),
		PlacementDrops: n.placementDrops.Load(), UnknownWorkers: n.unknownWorkers.Load(),
		ReuseDrops: n.reuseDrops.Load(), ReuseUnreported: n.reuseUnreported.Load(),
		WritesRefused: n.writesRefused.Load(), AnnouncesRefused: n.announcesRefused.Load(),
		Malformed: n.malformed.Load(), StaleAnswers: n.staleAnswers.Load()}
	for r := range n.outcomes {
		out.Outcomes[Reason(r)] = n.outcomes[r].Load()
	}
	return out
}
