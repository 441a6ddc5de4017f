package kvix

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// Errors a request may wrap; ServerError carries a server's refusal.
var (
	// ErrNotConnected: no server was up to take the request.
	ErrNotConnected = errors.New("kvix: no server connected")
	// ErrClosed: the connection closed before the reply came.
	ErrClosed = errors.New("kvix: connection closed")
	// ErrMalformed: the server sent a frame this client cannot read.
	ErrMalformed = errors.New("kvix: malformed reply")
	// ErrTooLarge: the request does not fit in the server's frame limit.
	ErrTooLarge = errors.New("kvix: request too large")
)

// ServerError is a server's ErrorReply to a request.
type ServerError struct {
	Code    wire.ErrorCode
	Message string
}

func (e *ServerError) Error() string { return fmt.Sprintf("kvix: %v: %s", e.Code, e.Message) }

// noReplyBit marks the ids of requests sent without a reply wanted, so that a refused
// write's ErrorReply is told from a late reply.
const noReplyBit = 1 << 63

type reply struct {
	msg  wire.Message
	err  error
	from *conn
}

// conn is one connection after its handshake: requests are pipelined, replies matched
// by id by one reader goroutine.
type conn struct {
	addr    string
	nc      net.Conn
	welcome *wire.Welcome
	refused func(wire.ErrorCode) // a write sent without a reply was refused

	wmu  sync.Mutex
	wbuf []byte

	nextID  atomic.Uint64
	pmu     sync.Mutex
	pending map[uint64]chan reply

	done    chan struct{}
	once    sync.Once
	doneErr error
}

// dial connects to addr ("host:port" or "unix:/path") and says Hello.
func dial(ctx context.Context, cfg *Config, addr string, refused func(wire.ErrorCode)) (*conn, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	var d net.Dialer
	var nc net.Conn
	var err error
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		nc, err = d.DialContext(ctx, "unix", path)
	} else if cfg.TLS != nil {
		tc := cfg.TLS.Clone()
		if tc.ServerName == "" {
			host, _, _ := net.SplitHostPort(addr)
			tc.ServerName = host
		}
		td := tls.Dialer{NetDialer: &d, Config: tc}
		nc, err = td.DialContext(ctx, "tcp", addr)
	} else {
		nc, err = d.DialContext(ctx, "tcp", addr)
		if tcp, ok := nc.(*net.TCPConn); ok {
			_ = tcp.SetNoDelay(true)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kvix: connect %s: %w", addr, err)
	}
	c := &conn{addr: addr, nc: nc, refused: refused, pending: map[uint64]chan reply{},
		done: make(chan struct{})}
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	hello := &wire.Hello{Client: cfg.Name, TokenBlock: cfg.TokenBlock}
	if cfg.Auth != "" {
		hello.Auth = &cfg.Auth
	}
	buf, _ := wire.Append(nil, hello, 0, 0)
	if _, err := nc.Write(buf); err != nil {
		nc.Close()
		return nil, fmt.Errorf("kvix: hello to %s: %w", addr, err)
	}
	r := newFrameReader(nc, wire.MaxHelloFrame)
	m, _, err := r.next()
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("kvix: hello to %s: %w", addr, err)
	}
	switch m := m.(type) {
	case *wire.Welcome:
		c.welcome = m
	case *wire.ErrorReply:
		nc.Close()
		return nil, fmt.Errorf("kvix: %s refused the hello: %w", addr, &ServerError{m.Code, m.Message})
	default:
		nc.Close()
		return nil, fmt.Errorf("kvix: hello to %s: %w: %v where Welcome was due", addr, ErrMalformed, m.Kind())
	}
	_ = nc.SetDeadline(time.Time{})
	r.max = cfg.MaxFrame
	go c.readLoop(r)
	return c, nil
}

// send writes m; its reply goes to ch (buffered), or nowhere when ch is nil (the
// request is sent with FlagNoReply).
func (c *conn) send(m wire.Message, ch chan reply) (uint64, error) {
	id := c.nextID.Add(1) &^ noReplyBit
	flags := uint8(0)
	if ch == nil {
		id |= noReplyBit
		flags = wire.FlagNoReply
	} else {
		c.pmu.Lock()
		c.pending[id] = ch
		c.pmu.Unlock()
	}
	c.wmu.Lock()
	var err error
	c.wbuf, err = wire.Append(c.wbuf[:0], m, id, flags)
	if err == nil && len(c.wbuf) > int(c.welcome.MaxFrame) {
		err = fmt.Errorf("%w: a %v of %d bytes is past the server's frame limit of %d", ErrTooLarge, m.Kind(), len(c.wbuf), c.welcome.MaxFrame)
	}
	written := err == nil
	if written {
		_, err = c.nc.Write(c.wbuf)
	}
	c.wmu.Unlock()
	if err != nil {
		c.forget(id)
		if written {
			// A failed write leaves the stream cut mid-frame: nothing more can go on it.
			c.close(err)
		}
		return 0, err
	}
	return id, nil
}

// writeFrames writes frames already encoded (placements, reports) in one call.
func (c *conn) writeFrames(b []byte) error {
	c.wmu.Lock()
	_, err := c.nc.Write(b)
	c.wmu.Unlock()
	if err != nil {
		c.close(err)
	}
	return err
}

func (c *conn) forget(id uint64) {
	c.pmu.Lock()
	delete(c.pending, id)
	c.pmu.Unlock()
}

// request sends m and waits for its reply until ctx is done.
func (c *conn) request(ctx context.Context, m wire.Message) (wire.Message, error) {
	ch := make(chan reply, 1)
	id, err := c.send(m, ch)
	if err != nil {
		return nil, err
	}
	select {
	case r := <-ch:
		return r.msg, r.err
	case <-ctx.Done():
		c.forget(id)
		return nil, ctx.Err()
	}
}

func (c *conn) close(err error) {
	c.once.Do(func() {
		c.doneErr = err
		c.nc.Close()
		close(c.done)
		c.pmu.Lock()
		for id, ch := range c.pending {
			ch <- reply{err: fmt.Errorf("%w: %s: %v", ErrClosed, c.addr, err), from: c}
			delete(c.pending, id)
		}
		c.pmu.Unlock()
	})
}

func (c *conn) readLoop(r *frameReader) {
	for {
		m, h, err := r.next()
		if err != nil {
			c.close(err)
			return
		}
		if h.RequestID&noReplyBit != 0 {
			if e, ok := m.(*wire.ErrorReply); ok && c.refused != nil {
				c.refused(e.Code)
			}
			continue
		}
		c.pmu.Lock()
		ch, ok := c.pending[h.RequestID]
		delete(c.pending, h.RequestID)
		c.pmu.Unlock()
		if ok {
			ch <- reply{msg: m, from: c}
		}
	}
}

// frameReader cuts frames out of a byte stream.
type frameReader struct {
	nc  net.Conn
	buf []byte
	at  int
	max uint32
}

func newFrameReader(nc net.Conn, max uint32) *frameReader {
	return &frameReader{nc: nc, buf: make([]byte, 0, 64<<10), max: max}
}

func (r *frameReader) next() (wire.Message, wire.Header, error) {
	for {
		f, ok, err := wire.SplitFrame(r.buf[r.at:], r.max)
		if err != nil {
			return nil, wire.Header{}, fmt.Errorf("%w: %v", ErrMalformed, err)
		}
		if ok {
			r.at += f.Len
			m, err := f.Message()
			if err != nil {
				return nil, f.Header, fmt.Errorf("%w: %v", ErrMalformed, err)
			}
			return m, f.Header, nil
		}
		if r.at > 0 {
			r.buf = r.buf[:copy(r.buf, r.buf[r.at:])]
			r.at = 0
		}
		if len(r.buf) == cap(r.buf) {
			r.buf = append(r.buf, make([]byte, cap(r.buf))...)[:len(r.buf)]
		}
		n, err := r.nc.Read(r.buf[len(r.buf):cap(r.buf)])
		r.buf = r.buf[:len(r.buf)+n]
		if err != nil && n == 0 {
			return nil, wire.Header{}, err
		}
	}
}
