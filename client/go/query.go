package kvix

import (
	"context"
	"errors"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// Reason says what a query's Outcome is: scores, or why to route without the index.
type Reason uint8

// The outcomes. Everything but ReasonScores means: route without the index.
const (
	ReasonScores       Reason = iota // the answer scored workers
	ReasonEmpty                      // no worker holds any of the prompt
	ReasonTimeout                    // no answer by the deadline (or the context ended)
	ReasonDisconnected               // no server up, or every one lost mid-query
	ReasonRejected                   // the server refused the query (Err says why)
)

var reasonNames = [...]string{"scores", "empty", "timeout", "disconnected", "rejected"}

func (r Reason) String() string { return reasonNames[r] }

// WorkerScore is one worker's reusable prefix for a prompt.
type WorkerScore struct {
	Worker      uint32
	Name        string // "" until the roster names the id
	Blocks      uint32 // the joint depth: blocks reusable from any tier
	Tiers       wire.Depths
	Reuse       float64            // Tiers weighed by the query's weights, in GPU blocks
	HistoryLost bool               // the engine may hold more than Blocks
	Suspect     *wire.SuspectCause // the server doubts this score (reuse verdicts)
}

// ExpectedReuse is Reuse discounted where the server finds the worker's events lag.
func (s WorkerScore) ExpectedReuse() float64 {
	if s.Suspect != nil && *s.Suspect == wire.SuspectEventsLagging {
		return s.Reuse / 2
	}
	return s.Reuse
}

// Outcome is a query's result; a query never fails, it fails open.
type Outcome struct {
	Reason Reason
	Scores []WorkerScore // best first; only with ReasonScores
	Err    error         // with ReasonRejected: the *ServerError; with ReasonTimeout: the context's error, if it ended first
}

// Best is the best-scored worker, if any.
func (o Outcome) Best() (WorkerScore, bool) {
	if len(o.Scores) == 0 {
		return WorkerScore{}, false
	}
	return o.Scores[0], true
}

// QueryOptions narrows a query.
type QueryOptions struct {
	Candidates []string          // only these workers, by name; empty: all
	TopK       uint32            // at most this many scores; 0: all
	Deadline   time.Duration     // 0: the Config's
	Weights    *wire.TierWeights // nil: the Config's
}

// QueryTokens asks which workers can reuse how much of a prompt of token ids.
func (c *Client) QueryTokens(ctx context.Context, ks wire.Keyspace, tokens []uint32, opts QueryOptions) Outcome {
	return c.QueryChain(ctx, ks, c.TokenChain(ks, tokens), opts)
}

// QueryChain asks with a chain computed already (TokenChain, ByteChain). It returns by
// its deadline: the options', else the Config's, or ctx's if earlier.
func (c *Client) QueryChain(ctx context.Context, ks wire.Keyspace, chain []uint64, opts QueryOptions) Outcome {
	start := time.Now()
	o := c.query(ctx, start, ks, chain, &opts)
	c.counters.record(o.Reason, time.Since(start))
	return o
}

// attempt is a query sent to one server.
type attempt struct {
	s  *server
	cn *conn
	id uint64
}

func (c *Client) query(ctx context.Context, start time.Time, ks wire.Keyspace, chain []uint64, opts *QueryOptions) Outcome {
	d := opts.Deadline
	if d <= 0 {
		d = c.cfg.Deadline
	}
	deadline := start.Add(d)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	weights := c.cfg.Weights
	if opts.Weights != nil {
		weights = *opts.Weights
	}
	q := &wire.TieredQuery{Query: wire.Query{Keyspace: ks, Chain: chain, TopK: opts.TopK}, Weights: weights}
	replies := make(chan reply, len(c.servers))
	var sent []attempt
	tried := 0
	// sendNext sends to the next server up not tried yet: false when none is left.
	sendNext := func() (bool, *Outcome) {
		for tried < len(c.servers) {
			s := c.servers[tried]
			tried++
			cn := s.conn()
			if cn == nil {
				continue
			}
			if !c.candidates(s, q, opts.Candidates) {
				return true, &Outcome{Reason: ReasonEmpty}
			}
			id, err := cn.send(q, replies)
			if err != nil {
				if errors.Is(err, ErrTooLarge) {
					return true, &Outcome{Reason: ReasonRejected, Err: err}
				}
				continue
			}
			sent = append(sent, attempt{s, cn, id})
			return true, nil
		}
		return false, nil
	}
	defer func() {
		for _, a := range sent {
			a.cn.forget(a.id)
		}
	}()
	if ok, early := sendNext(); early != nil {
		return *early
	} else if !ok {
		return Outcome{Reason: ReasonDisconnected}
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	var hedge <-chan time.Time
	if h := c.hedgeAfter(d); h > 0 && len(c.servers) > 1 {
		ht := time.NewTimer(h)
		defer ht.Stop()
		hedge = ht.C
	}
	inFlight := 1
	// The first answer of a replica behind its log: returned only if no other answers.
	var stale *reply
	fallback := func(o Outcome) Outcome {
		if stale != nil {
			return c.outcome(c.serverOf(sent, stale.from), stale.msg, weights)
		}
		return o
	}
	for {
		select {
		case r := <-replies:
			a, isAnswer := r.msg.(*wire.TieredAnswer)
			if r.err == nil && isAnswer && a.Stale {
				// That replica is healing or stopped following its log: ask the next.
				c.counters.staleAnswers.Add(1)
				if stale == nil {
					stale = &r
				}
			}
			if r.err != nil || (isAnswer && a.Stale) {
				inFlight--
				if ok, early := sendNext(); early != nil {
					return *early
				} else if ok {
					inFlight++
				} else if inFlight == 0 {
					return fallback(Outcome{Reason: ReasonDisconnected})
				}
				continue
			}
			return c.outcome(c.serverOf(sent, r.from), r.msg, weights)
		case <-hedge:
			hedge = nil
			if ok, _ := sendNext(); ok {
				inFlight++
				c.counters.hedges.Add(1)
			}
		case <-timer.C:
			return fallback(Outcome{Reason: ReasonTimeout})
		case <-ctx.Done():
			return fallback(Outcome{Reason: ReasonTimeout, Err: ctx.Err()})
		}
	}
}

func (c *Client) hedgeAfter(deadline time.Duration) time.Duration {
	if c.cfg.HedgeAfter < 0 {
		return 0
	}
	if c.cfg.HedgeAfter == 0 {
		return deadline / 4
	}
	return c.cfg.HedgeAfter
}

func (c *Client) serverOf(sent []attempt, cn *conn) *server {
	for _, a := range sent {
		if a.cn == cn {
			return a.s
		}
	}
	return sent[0].s
}

// candidates translates names to s's ids into q: false when names were given and s
// knows none of them (nothing to score there).
func (c *Client) candidates(s *server, q *wire.TieredQuery, names []string) bool {
	q.Candidates = q.Candidates[:0]
	if len(names) == 0 {
		return true
	}
	for _, n := range names {
		if id, ok := s.roster.id(n); ok {
			q.Candidates = append(q.Candidates, id)
		} else {
			s.roster.wantName(n)
			s.askRelist()
		}
	}
	return len(q.Candidates) > 0
}

func (c *Client) outcome(s *server, m wire.Message, w wire.TierWeights) Outcome {
	switch a := m.(type) {
	case *wire.TieredAnswer:
		if s.roster.stale(a.Reissued) {
			s.askRelist()
		}
		if len(a.Scores) == 0 {
			return Outcome{Reason: ReasonEmpty}
		}
		scores := make([]WorkerScore, len(a.Scores))
		for i, ts := range a.Scores {
			name, ok := s.roster.name(ts.Worker)
			if !ok {
				s.askRelist()
			}
			scores[i] = WorkerScore{Worker: ts.Worker, Name: name, Blocks: ts.Tiers.Storage,
				Tiers: ts.Tiers, Reuse: ts.Tiers.Weighed(w), Suspect: ts.Suspect}
			for _, lost := range a.HistoryLost {
				scores[i].HistoryLost = scores[i].HistoryLost || lost == ts.Worker
			}
		}
		return Outcome{Reason: ReasonScores, Scores: scores}
	case *wire.ErrorReply:
		return Outcome{Reason: ReasonRejected, Err: &ServerError{a.Code, a.Message}}
	}
	c.counters.malformed.Add(1)
	return Outcome{Reason: ReasonRejected, Err: unexpected(m, wire.KindTieredAnswer)}
}
