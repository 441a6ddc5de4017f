package kvix

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// Client keeps one connection to each configured server. Create it with Connect and
// stop it with Close.
type Client struct {
	cfg      Config
	servers  []*server
	counters counters

	mu    sync.Mutex
	owned map[string]*wire.Announce // announced by this client: re-announced on every connect

	placements chan placement
	reports    chan ReuseSample

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// server is one configured server: its connection while up, and its roster.
type server struct {
	addr   string
	cur    atomic.Pointer[conn]
	roster roster
	// changed is closed and replaced whenever the connection comes up or goes down.
	mu      sync.Mutex
	changed chan struct{}
	// relist asks the supervisor for the roster now (an unknown id or name was seen).
	relist chan struct{}
}

func (s *server) conn() *conn { return s.cur.Load() }

func (s *server) set(c *conn) {
	s.cur.Store(c)
	s.mu.Lock()
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

func (s *server) watch() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *server) askRelist() {
	select {
	case s.relist <- struct{}{}:
	default:
	}
}

// Connect validates cfg and starts connecting to every server in the background. It
// does not wait for a connection: see WaitConnected.
func Connect(cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Client{cfg: cfg, owned: map[string]*wire.Announce{},
		placements: make(chan placement, cfg.Queue), reports: make(chan ReuseSample, cfg.Queue),
		ctx: ctx, cancel: cancel}
	for _, addr := range cfg.Servers {
		s := &server{addr: addr, changed: make(chan struct{}), relist: make(chan struct{}, 1)}
		s.roster.init()
		c.servers = append(c.servers, s)
		c.wg.Add(1)
		go c.supervise(s)
	}
	c.wg.Add(2)
	go c.sendPlacements()
	go c.sendReports()
	return c, nil
}

// Close stops the client: connections close, queued placements and reports are dropped.
func (c *Client) Close() error {
	c.cancel()
	for _, s := range c.servers {
		if cn := s.conn(); cn != nil {
			cn.close(ErrClosed)
		}
	}
	c.wg.Wait()
	return nil
}

// Connected says whether some server is up.
func (c *Client) Connected() bool { return c.primary() != nil }

// WaitConnected waits until some server is up, or ctx is done.
func (c *Client) WaitConnected(ctx context.Context) error {
	for !c.Connected() {
		watches := make([]<-chan struct{}, len(c.servers))
		for i, s := range c.servers {
			watches[i] = s.watch()
		}
		if c.Connected() {
			return nil
		}
		// Whichever server changes first wakes this; a short poll covers the others.
		select {
		case <-watches[0]:
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// primary is the first server up.
func (c *Client) primary() *server {
	for _, s := range c.servers {
		if s.conn() != nil {
			return s
		}
	}
	return nil
}

// writeTargets are the servers a write goes to: every one up, or the first up with Replicas.
func (c *Client) writeTargets() []*server {
	var out []*server
	for _, s := range c.servers {
		if s.conn() != nil {
			out = append(out, s)
			if c.cfg.Replicas {
				break
			}
		}
	}
	return out
}

// supervise keeps s connected: dial, re-announce, list the roster, then refresh the
// roster every second until the connection drops; retry with exponential backoff.
func (c *Client) supervise(s *server) {
	defer c.wg.Done()
	backoff := c.cfg.ReconnectMin
	refused := func(code wire.ErrorCode) { c.counters.writesRefused.Add(1) }
	for c.ctx.Err() == nil {
		cn, err := dial(c.ctx, &c.cfg, s.addr, refused)
		if err == nil {
			err = c.prepare(s, cn)
			if err != nil {
				cn.close(err)
			}
		}
		if err != nil {
			c.counters.connectFailures.Add(1)
			select {
			case <-time.After(backoff):
			case <-c.ctx.Done():
				return
			}
			backoff = min(2*backoff, c.cfg.ReconnectMax)
			continue
		}
		backoff = c.cfg.ReconnectMin
		c.counters.connects.Add(1)
		s.set(cn)
		tick := time.NewTicker(time.Second)
		for up := true; up; {
			select {
			case <-cn.done:
				up = false
			case <-c.ctx.Done():
				up = false
			case <-tick.C:
				_ = c.listRoster(s, cn, false)
			case <-s.relist:
				_ = c.listRoster(s, cn, false)
			}
		}
		tick.Stop()
		s.set(nil)
	}
}

// prepare readies a new connection before anything else is sent on it: every worker
// this client owns is announced again (a restarted server may know none of them), and
// the roster is listed from 0 (it may number workers anew).
func (c *Client) prepare(s *server, cn *conn) error {
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.ConnectTimeout)
	defer cancel()
	c.mu.Lock()
	owned := make([]*wire.Announce, 0, len(c.owned))
	for _, a := range c.owned {
		owned = append(owned, a)
	}
	c.mu.Unlock()
	s.roster.reset()
	for _, a := range owned {
		_, err := c.announceOn(ctx, s, cn, a)
		var refused *ServerError
		if errors.As(err, &refused) {
			// This server refuses the roster (another block size, say): the others
			// may not, and the connection serves everything else.
			c.counters.announcesRefused.Add(1)
			continue
		}
		if err != nil {
			return err
		}
	}
	return c.listRoster(s, cn, true)
}

// listRoster pages through the server's roster: from the last id seen, or from 0.
func (c *Client) listRoster(s *server, cn *conn, fromZero bool) error {
	ctx, cancel := context.WithTimeout(c.ctx, c.cfg.RequestTimeout)
	defer cancel()
	from := s.roster.nextID(fromZero)
	for {
		m, err := cn.request(ctx, &wire.RosterRequest{From: from, Names: s.roster.wanted()})
		if err != nil {
			return err
		}
		r, ok := m.(*wire.Roster)
		if !ok {
			return unexpected(m, wire.KindRoster)
		}
		if s.roster.page(r, from == 0) {
			// Ids were given to other names since: list everything again.
			from = 0
			continue
		}
		if !r.More {
			return nil
		}
		from = r.Next
	}
}

func unexpected(m wire.Message, want wire.Kind) error {
	if e, ok := m.(*wire.ErrorReply); ok {
		return &ServerError{e.Code, e.Message}
	}
	return fmt.Errorf("%w: %v where %v was due", ErrMalformed, m.Kind(), want)
}

// WorkerID is the id the first server up gave name, if it knows it.
func (c *Client) WorkerID(name string) (uint32, bool) {
	if s := c.primary(); s != nil {
		return s.roster.id(name)
	}
	return 0, false
}

// TokenChain is the chain of tokens' whole blocks in ks at this client's block size.
func (c *Client) TokenChain(ks wire.Keyspace, tokens []uint32) []uint64 {
	return wire.TokenChain(ks.Seed(c.cfg.TokenBlock), c.cfg.TokenBlock, tokens)
}

// ByteChain is the chain of raw bytes' whole chunks in the byte keyspace ks.
func (c *Client) ByteChain(ks wire.Keyspace, b []byte) []uint64 {
	return wire.ByteChain(ks.Seed(c.cfg.TokenBlock), wire.ByteChunk, b)
}

// request sends a control request to the first server up, bounded by ctx or, without
// a deadline, by RequestTimeout.
func (c *Client) request(ctx context.Context, m wire.Message) (wire.Message, error) {
	s := c.primary()
	if s == nil {
		return nil, ErrNotConnected
	}
	ctx, cancel := c.bounded(ctx)
	defer cancel()
	return s.conn().request(ctx, m)
}

func (c *Client) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.cfg.RequestTimeout)
}

// Stats asks the first server up for its figures.
func (c *Client) Stats(ctx context.Context) (*wire.Stats, error) {
	m, err := c.request(ctx, &wire.StatsRequest{})
	if err != nil {
		return nil, err
	}
	if s, ok := m.(*wire.Stats); ok {
		return s, nil
	}
	return nil, unexpected(m, wire.KindStats)
}

// Echo sends payload and gets replyLen bytes back: the transport's round trip.
func (c *Client) Echo(ctx context.Context, payload []byte, replyLen uint32) ([]byte, error) {
	m, err := c.request(ctx, &wire.Echo{Payload: payload, ReplyLen: replyLen})
	if err != nil {
		return nil, err
	}
	if e, ok := m.(*wire.Echo); ok {
		return e.Payload, nil
	}
	return nil, unexpected(m, wire.KindEcho)
}
