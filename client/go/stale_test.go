package kvix

import (
	"net"
	"testing"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// staleFake is a server that answers every query for worker `worker`, saying `stale`
// when told (a replica healing in place, or stopped following its log); it names no
// worker, and knows nothing else.
func staleFake(t *testing.T, worker uint32, stale bool) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			go serveFake(c, worker, stale)
		}
	}()
	return l.Addr().String()
}

func serveFake(c net.Conn, worker uint32, stale bool) {
	var buf []byte
	chunk := make([]byte, 64<<10)
	for {
		f, ok, err := wire.SplitFrame(buf, wire.DefaultMaxFrame)
		if err != nil {
			return
		}
		if !ok {
			n, err := c.Read(chunk)
			if err != nil {
				return
			}
			buf = append(buf, chunk[:n]...)
			continue
		}
		var reply wire.Message
		switch f.Header.Kind {
		case wire.KindHello:
			reply = &wire.Welcome{Server: "fake", TokenBlock: 16, ByteChunk: wire.ByteChunk, Shards: 1, MaxFrame: wire.DefaultMaxFrame}
		case wire.KindRosterRequest:
			reply = &wire.Roster{}
		case wire.KindTieredQuery:
			reply = &wire.TieredAnswer{Stale: stale,
				Scores: []wire.TieredScore{{Worker: worker, Tiers: wire.Depths{GPU: 2, CPU: 2, Storage: 2}}}}
		}
		id := f.Header.RequestID
		buf = buf[f.Len:]
		if reply == nil {
			continue
		}
		out, err := wire.Append(nil, reply, id, 0)
		if err != nil {
			return
		}
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

// A replica that says its copy is behind its log is passed over: the query goes on to
// the next server, whose answer is taken; with every server stale, the first stale
// answer is better than none.
func TestAStaleAnswerSendsTheQueryOnToTheNextServer(t *testing.T) {
	for _, tc := range []struct {
		name       string
		staleFirst bool
		staleNext  bool
		worker     uint32
	}{
		{"the next one answers", true, false, 2},
		{"every server stale", true, true, 1},
		{"none stale", false, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Servers = []string{staleFake(t, 1, tc.staleFirst), staleFake(t, 2, tc.staleNext)}
			cfg.Replicas, cfg.Deadline, cfg.HedgeAfter = true, time.Second, -1
			c, err := Connect(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			eventually(t, "both servers up", func() bool {
				return c.servers[0].conn() != nil && c.servers[1].conn() != nil
			})
			o := c.QueryChain(bg, wire.Keyspace{Model: "m"}, []uint64{1, 2}, QueryOptions{})
			if o.Reason != ReasonScores || o.Scores[0].Worker != tc.worker {
				t.Fatalf("%+v", o)
			}
			want := uint64(0)
			if tc.staleFirst {
				want++
				if tc.staleNext {
					want++
				}
			}
			if got := c.Counters().StaleAnswers; got != want {
				t.Fatalf("stale answers %d, want %d", got, want)
			}
		})
	}
}
