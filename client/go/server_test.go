package kvix

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvix/kvix/client/go/kvixtest"
	"github.com/kvix/kvix/client/go/wire"
)

// startServer starts a real kvix-server (kvixtest) with args, and a Unix socket when unix.
func startServer(t testing.TB, unix bool, args ...string) *kvixtest.Server {
	t.Helper()
	if unix {
		args = append(args, "--unix", filepath.Join(t.TempDir(), "kvix.sock"))
	}
	return kvixtest.Start(t, args...)
}

// statsOf asks srv for its Stats through a connection of c's config.
func statsOf(srv *kvixtest.Server, c *Client) (*wire.Stats, error) {
	cn, err := dial(bg, &c.cfg, srv.Addr, nil)
	if err != nil {
		return nil, err
	}
	defer cn.close(ErrClosed)
	m, err := cn.request(bg, &wire.StatsRequest{})
	if err != nil {
		return nil, err
	}
	st, ok := m.(*wire.Stats)
	if !ok {
		return nil, unexpected(m, wire.KindStats)
	}
	return st, nil
}

// connect makes a client of these servers with cfg's other fields, connected.
func connect(t testing.TB, edit func(*Config), servers ...string) *Client {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Servers = servers
	cfg.Deadline = 2 * time.Second // contract tests count; they do not time
	if edit != nil {
		edit(&cfg)
	}
	c, err := Connect(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.WaitConnected(ctx); err != nil {
		t.Fatalf("never connected to %v: %v", servers, err)
	}
	return c
}

var eventually = kvixtest.Eventually

func tokens(n int, from uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

func describe(o Outcome) string {
	return fmt.Sprintf("%v %+v %v", o.Reason, o.Scores, o.Err)
}
