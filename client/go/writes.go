package kvix

import (
	"context"
	"errors"

	"github.com/kvix/kvix/client/go/wire"
)

// Announce registers a worker under name with its lanes and feed on every server up
// (the first up with Replicas), and returns the first one's id. The client owns it
// from then on: it is announced again on every (re)connect, until Retire. With no
// server up it returns ErrNotConnected, and it will be announced at the next connect.
func (c *Client) Announce(ctx context.Context, name string, lanes []wire.Lane, feed wire.Feed) (uint32, error) {
	return c.AnnounceWorker(ctx, &wire.Announce{Name: name, Lanes: lanes, Feed: feed})
}

// AnnounceWorker is Announce with every field of the message (an event source).
func (c *Client) AnnounceWorker(ctx context.Context, a *wire.Announce) (uint32, error) {
	c.mu.Lock()
	c.owned[a.Name] = a
	c.mu.Unlock()
	targets := c.writeTargets()
	if len(targets) == 0 {
		return 0, ErrNotConnected
	}
	ctx, cancel := c.bounded(ctx)
	defer cancel()
	var id uint32
	var first error
	for i, s := range targets {
		got, err := c.announceOn(ctx, s, s.conn(), a)
		if i == 0 {
			id, first = got, err
		}
	}
	var refused *ServerError
	if errors.As(first, &refused) {
		// A roster the server refuses is not announced again at every connect.
		c.mu.Lock()
		if c.owned[a.Name] == a {
			delete(c.owned, a.Name)
		}
		c.mu.Unlock()
	}
	return id, first
}

func (c *Client) announceOn(ctx context.Context, s *server, cn *conn, a *wire.Announce) (uint32, error) {
	if cn == nil {
		return 0, ErrNotConnected
	}
	m, err := cn.request(ctx, a)
	if err != nil {
		return 0, err
	}
	ok, isOK := m.(*wire.Announced)
	if !isOK {
		return 0, unexpected(m, wire.KindAnnounced)
	}
	s.roster.learn(a.Name, ok.Worker)
	return ok.Worker, nil
}

// Retire forgets the worker named name on every server up (the first with Replicas);
// this client stops announcing it.
func (c *Client) Retire(ctx context.Context, name string) error {
	c.mu.Lock()
	delete(c.owned, name)
	c.mu.Unlock()
	targets := c.writeTargets()
	if len(targets) == 0 {
		return ErrNotConnected
	}
	ctx, cancel := c.bounded(ctx)
	defer cancel()
	var first error
	for i, s := range targets {
		err := c.retireOn(ctx, s, name)
		if i == 0 {
			first = err
		}
	}
	return first
}

func (c *Client) retireOn(ctx context.Context, s *server, name string) error {
	id, ok := s.roster.id(name)
	if !ok {
		return &ServerError{wire.CodeUnknownWorker, "no worker " + name + " on " + s.addr}
	}
	m, err := s.conn().request(ctx, &wire.Retire{Worker: id})
	if err != nil {
		return err
	}
	if _, ok := m.(*wire.Ack); !ok {
		return unexpected(m, wire.KindAck)
	}
	return nil
}

type placement struct {
	worker string
	ks     wire.Keyspace
	chain  []uint64
}

// most frames gathered into one write by the placement and report senders.
const batch = 256

// PublishPlacement says a request whose prompt has chain went to worker: a worker
// fed by placements is assumed to hold those blocks now. It never blocks: false,
// counted, when no server knows the worker or the queue is full.
func (c *Client) PublishPlacement(worker string, ks wire.Keyspace, chain []uint64) bool {
	known := false
	for _, s := range c.servers {
		if _, ok := s.roster.id(worker); ok {
			known = true
		} else if s.conn() != nil {
			s.roster.wantName(worker)
			s.askRelist()
		}
	}
	if !known {
		c.counters.unknownWorkers.Add(1)
		return false
	}
	select {
	case c.placements <- placement{worker, ks, chain}:
		return true
	default:
		c.counters.placementDrops.Add(1)
		return false
	}
}

func (c *Client) sendPlacements() {
	defer c.wg.Done()
	var buf []byte
	for {
		var p []placement
		select {
		case first := <-c.placements:
			p = append(p, first)
		case <-c.ctx.Done():
			return
		}
		for more := true; more && len(p) < batch; {
			select {
			case next := <-c.placements:
				p = append(p, next)
			default:
				more = false
			}
		}
		for _, s := range c.writeTargets() {
			cn := s.conn()
			if cn == nil {
				continue
			}
			buf = buf[:0]
			for _, pl := range p {
				id, ok := s.roster.id(pl.worker)
				if !ok {
					c.counters.unknownWorkers.Add(1)
					continue
				}
				m := &wire.Placement{Worker: id, Keyspace: pl.ks, Chain: pl.chain}
				var err error
				buf, err = wire.Append(buf, m, cn.nextID.Add(1)|noReplyBit, wire.FlagNoReply)
				if err != nil {
					c.counters.placementDrops.Add(1)
				}
			}
			if len(buf) > 0 && cn.writeFrames(buf) != nil {
				c.counters.placementDrops.Add(uint64(len(p)))
			}
		}
	}
}

// ReuseSample is what one routed request reused, as its engine reported it
// (usage.prompt_tokens_details.cached_tokens of an OpenAI-style response).
type ReuseSample struct {
	Worker          string
	Model           string
	PredictedTokens *uint32 // the reuse the answer predicted, in tokens; nil: the worker was not in the answer
	CachedTokens    *uint32 // nil: the response carried no figure (no report, never 0)
	PromptTokens    uint32
}

// ReportReuse queues a reuse report for the first server up. It never blocks: false,
// counted, when the engine gave no figure or the queue is full.
func (c *Client) ReportReuse(r ReuseSample) bool {
	if r.CachedTokens == nil {
		c.counters.reuseUnreported.Add(1)
		return false
	}
	select {
	case c.reports <- r:
		return true
	default:
		c.counters.reuseDrops.Add(1)
		return false
	}
}

func (c *Client) sendReports() {
	defer c.wg.Done()
	var buf []byte
	for {
		var batchOf []ReuseSample
		select {
		case first := <-c.reports:
			batchOf = append(batchOf, first)
		case <-c.ctx.Done():
			return
		}
		for more := true; more && len(batchOf) < batch; {
			select {
			case next := <-c.reports:
				batchOf = append(batchOf, next)
			default:
				more = false
			}
		}
		s := c.primary()
		if s == nil {
			c.counters.reuseDrops.Add(uint64(len(batchOf)))
			continue
		}
		m := &wire.ReuseReport{}
		for _, r := range batchOf {
			id, ok := s.roster.id(r.Worker)
			if !ok {
				c.counters.reuseDrops.Add(1)
				continue
			}
			m.Reports = append(m.Reports, wire.Reuse{Worker: id, Model: r.Model,
				PredictedTokens: r.PredictedTokens, CachedTokens: *r.CachedTokens, PromptTokens: r.PromptTokens})
		}
		cn := s.conn()
		if len(m.Reports) == 0 || cn == nil {
			continue
		}
		var err error
		buf, err = wire.Append(buf[:0], m, cn.nextID.Add(1)|noReplyBit, wire.FlagNoReply)
		if err == nil {
			err = cn.writeFrames(buf)
		}
		if err != nil {
			c.counters.reuseDrops.Add(uint64(len(m.Reports)))
		}
	}
}
