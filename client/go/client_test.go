package kvix

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvix/kvix/client/go/kvixtest"
	"github.com/kvix/kvix/client/go/wire"
)

var bg = context.Background()

// placed announces worker (fed by placements), places prompt on it and waits until
// an answer scores it.
func placed(t *testing.T, c *Client, worker string, ks wire.Keyspace, prompt []uint32) {
	t.Helper()
	if _, err := c.Announce(bg, worker, []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
		t.Fatal(err)
	}
	eventually(t, worker+" holds the prompt", func() bool {
		c.PublishPlacement(worker, ks, c.TokenChain(ks, prompt))
		best, ok := c.QueryTokens(bg, ks, prompt, QueryOptions{}).Best()
		return ok && best.Name == worker
	})
}

func placementsFeed() wire.Feed {
	return wire.Feed{Kind: wire.FeedPlacements, CapacityBlocks: 1 << 20}
}

func TestAPlacementIsAnsweredByNameOverTCPAndUnix(t *testing.T) {
	srv := startServer(t, true)
	for _, addr := range []string{srv.Addr, srv.Unix} {
		t.Run(addr[:4], func(t *testing.T) {
			c := connect(t, nil, addr)
			name := "w-" + addr[:4]
			if _, err := c.Announce(bg, name, []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
				t.Fatal(err)
			}
			ks := wire.TokensKeyspace("m-" + addr[:4])
			prompt := tokens(64, 1)
			if !c.PublishPlacement(name, ks, c.TokenChain(ks, prompt)) {
				t.Fatal("placement not queued")
			}
			var o Outcome
			eventually(t, "the placement is answered", func() bool {
				o = c.QueryTokens(bg, ks, prompt, QueryOptions{})
				return o.Reason == ReasonScores
			})
			best, _ := o.Best()
			if best.Name != name || best.Blocks != 4 || best.Tiers != (wire.Depths{GPU: 4, CPU: 4, Storage: 4}) || best.Reuse != 4 {
				t.Fatalf("got %s", describe(o))
			}
			if o := c.QueryTokens(bg, ks, tokens(64, 1000), QueryOptions{}); o.Reason != ReasonEmpty {
				t.Fatalf("an unknown prompt: %s", describe(o))
			}
		})
	}
}

func TestNamesAnnouncedByAnotherClientAreLearntFromTheRoster(t *testing.T) {
	srv := startServer(t, false)
	owner := connect(t, nil, srv.Addr)
	gateway := connect(t, nil, srv.Addr)
	ks := wire.TokensKeyspace("m")
	prompt := tokens(48, 7)
	for _, w := range []string{"a", "b"} {
		if _, err := owner.Announce(bg, w, []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
			t.Fatal(err)
		}
	}
	// The gateway never announced b: it learns the name and places for it.
	eventually(t, "the gateway learns b", func() bool {
		return gateway.PublishPlacement("b", ks, gateway.TokenChain(ks, prompt))
	})
	eventually(t, "b is scored by name", func() bool {
		o := gateway.QueryTokens(bg, ks, prompt, QueryOptions{})
		best, ok := o.Best()
		return ok && best.Name == "b" && best.Blocks == 3
	})
	// Candidates by name narrow the answer; a name no server knows scores nothing.
	if o := gateway.QueryTokens(bg, ks, prompt, QueryOptions{Candidates: []string{"a"}}); o.Reason != ReasonEmpty {
		t.Fatalf("candidate a holds nothing: %s", describe(o))
	}
	if o := gateway.QueryTokens(bg, ks, prompt, QueryOptions{Candidates: []string{"nobody"}}); o.Reason != ReasonEmpty {
		t.Fatalf("an unknown candidate: %s", describe(o))
	}
	if gateway.PublishPlacement("nobody", ks, []uint64{1}) {
		t.Fatal("a placement for an unknown worker was queued")
	}
	if n := gateway.Counters().UnknownWorkers; n == 0 {
		t.Fatal("the unknown worker was not counted")
	}
}

func TestQueriesFailOpenWhenNoServerIsUpAndReconnectReannounces(t *testing.T) {
	srv := startServer(t, false)
	addr := srv.Addr
	c := connect(t, func(c *Config) { c.ReconnectMax = 50 * time.Millisecond }, addr)
	if _, err := c.Announce(bg, "w", []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	eventually(t, "the client sees the server gone", func() bool { return !c.Connected() })
	if o := c.QueryTokens(bg, wire.TokensKeyspace("m"), tokens(32, 0), QueryOptions{}); o.Reason != ReasonDisconnected {
		t.Fatalf("with no server up: %s", describe(o))
	}
	if _, err := c.Stats(bg); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("stats with no server: %v", err)
	}
	// A server on the same port again, without state: the client re-announces w.
	srv2 := kvixtest.StartOn(t, addr)
	_ = srv2
	eventually(t, "the client reconnects and announces w again", func() bool {
		_, ok := c.WorkerID("w")
		return ok && c.Connected()
	})
	ks := wire.TokensKeyspace("m")
	prompt := tokens(32, 0)
	eventually(t, "w is placed and answered on the new server", func() bool {
		c.PublishPlacement("w", ks, c.TokenChain(ks, prompt))
		best, ok := c.QueryTokens(bg, ks, prompt, QueryOptions{}).Best()
		return ok && best.Name == "w"
	})
	if c.Counters().Connects < 2 {
		t.Fatalf("counters: %+v", c.Counters())
	}
}

func TestAQueryPastItsDeadlineTimesOutAndAContextEndsIt(t *testing.T) {
	srv := startServer(t, false)
	c := connect(t, nil, srv.Addr)
	ks := wire.TokensKeyspace("m")
	// A deadline already past: the answer cannot be waited for.
	o := c.QueryTokens(bg, ks, tokens(32, 0), QueryOptions{Deadline: time.Nanosecond})
	if o.Reason != ReasonTimeout {
		t.Fatalf("%s", describe(o))
	}
	ctx, cancel := context.WithCancel(bg)
	cancel()
	o = c.QueryTokens(ctx, ks, tokens(32, 0), QueryOptions{})
	if o.Reason != ReasonTimeout || !errors.Is(o.Err, context.Canceled) {
		t.Fatalf("a cancelled context: %s", describe(o))
	}
	if c.Counters().Outcomes[ReasonTimeout] != 2 {
		t.Fatalf("%+v", c.Counters())
	}
}

func TestTheHandshakeRefusesAWrongTokenAndAWrongBlockSize(t *testing.T) {
	srv := startServer(t, false, "--auth-token", "s3cr3t")
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		code  wire.ErrorCode
		works bool
	}{
		{"no token", nil, wire.CodeUnauthorized, false},
		{"wrong token", func(c *Config) { c.Auth = "nope" }, wire.CodeUnauthorized, false},
		{"wrong block", func(c *Config) { c.Auth = "s3cr3t"; c.TokenBlock = 32 }, wire.CodeBlockSizeMismatch, false},
		{"right", func(c *Config) { c.Auth = "s3cr3t" }, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Servers = []string{srv.Addr}
			if tc.edit != nil {
				tc.edit(&cfg)
			}
			_, err := dial(bg, &cfg, srv.Addr, nil)
			var se *ServerError
			switch {
			case tc.works && err != nil:
				t.Fatal(err)
			case !tc.works && (!errors.As(err, &se) || se.Code != tc.code):
				t.Fatalf("got %v, want %v", err, tc.code)
			}
		})
	}
}

func TestRetireForgetsAndABadRosterIsRefusedAndNotReannounced(t *testing.T) {
	srv := startServer(t, false)
	c := connect(t, nil, srv.Addr)
	ks := wire.TokensKeyspace("m")
	placed(t, c, "w", ks, tokens(32, 0))
	if err := c.Retire(bg, "w"); err != nil {
		t.Fatal(err)
	}
	if o := c.QueryTokens(bg, ks, tokens(32, 0), QueryOptions{}); o.Reason != ReasonEmpty {
		t.Fatalf("after retire: %s", describe(o))
	}
	// A lane of 24 tokens on a 16-token server is refused with BadLane.
	_, err := c.Announce(bg, "odd", []wire.Lane{wire.FullLane(24)}, placementsFeed())
	var se *ServerError
	if !errors.As(err, &se) || se.Code != wire.CodeBadLane {
		t.Fatalf("got %v", err)
	}
	c.mu.Lock()
	_, owned := c.owned["odd"]
	c.mu.Unlock()
	if owned {
		t.Fatal("a refused roster would be announced again at every connect")
	}
}

func TestStatsEchoAndReuseReportsReachTheServer(t *testing.T) {
	srv := startServer(t, false, "--metrics", "127.0.0.1:0")
	c := connect(t, nil, srv.Addr)
	back, err := c.Echo(bg, []byte{1, 2, 3}, 100)
	if err != nil || len(back) != 100 {
		t.Fatalf("echo: %d bytes, %v", len(back), err)
	}
	if _, err := c.Announce(bg, "w", []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
		t.Fatal(err)
	}
	st, err := c.Stats(bg)
	if err != nil || st.Workers != 1 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	if c.ReportReuse(ReuseSample{Worker: "w", Model: "m", PromptTokens: 64}) {
		t.Fatal("a response without cached tokens is not a report")
	}
	cached, predicted := uint32(32), uint32(48)
	for i := 0; i < 10; i++ {
		if !c.ReportReuse(ReuseSample{Worker: "w", Model: "m", PredictedTokens: &predicted, CachedTokens: &cached, PromptTokens: 64}) {
			t.Fatal("report not queued")
		}
	}
	eventually(t, "the server counts the 10 reports", func() bool {
		return srv.Metric(t, "kvix_reuse_reports_total") == 10
	})
	if n := c.Counters(); n.ReuseUnreported != 1 || n.ReuseDrops != 0 || n.WritesRefused != 0 {
		t.Fatalf("%+v", n)
	}
}

func TestManyGoroutinesShareOneClient(t *testing.T) {
	srv := startServer(t, false)
	c := connect(t, nil, srv.Addr)
	ks := wire.TokensKeyspace("m")
	placed(t, c, "w", ks, tokens(64, 0))
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				n := 16 * (1 + (g+i)%4)
				o := c.QueryTokens(bg, ks, tokens(n, 0), QueryOptions{})
				best, ok := o.Best()
				if !ok || best.Blocks != uint32(n/16) {
					errs <- describe(o)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatalf("a concurrent query got %s", e)
	}
}

func TestAStalledServerIsHedgedToTheNext(t *testing.T) {
	a, b := startServer(t, false), startServer(t, false)
	c := connect(t, func(c *Config) { c.HedgeAfter = 50 * time.Millisecond }, a.Addr, b.Addr)
	eventually(t, "both servers up", func() bool { return c.servers[0].conn() != nil && c.servers[1].conn() != nil })
	ks := wire.TokensKeyspace("m")
	if _, err := c.Announce(bg, "w", []wire.Lane{wire.FullLane(16)}, placementsFeed()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "both servers hold the placement", func() bool {
		c.PublishPlacement("w", ks, c.TokenChain(ks, tokens(32, 0)))
		st, err := statsOf(b, c)
		return err == nil && st.Blocks > 0 && c.QueryTokens(bg, ks, tokens(32, 0), QueryOptions{}).Reason == ReasonScores
	})
	// The first server stops answering but keeps its connection: the hedge answers.
	if err := a.Cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer a.Cmd.Process.Signal(syscall.SIGCONT)
	eventually(t, "the first server is stopped", func() bool {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", a.Cmd.Process.Pid))
		_, rest, _ := strings.Cut(string(stat), ") ")
		return err == nil && strings.HasPrefix(rest, "T")
	})
	o := c.QueryTokens(bg, ks, tokens(32, 0), QueryOptions{})
	if best, ok := o.Best(); !ok || best.Name != "w" || best.Blocks != 2 {
		t.Fatalf("hedged: %s", describe(o))
	}
	if n := c.Counters().Hedges; n != 1 {
		t.Fatalf("%d hedges", n)
	}
}

func TestTLS(t *testing.T) {
	dir := t.TempDir()
	roots := writePKI(t, dir)
	srv := startServer(t, false, "--tls-cert", filepath.Join(dir, "server.pem"), "--tls-key", filepath.Join(dir, "server.key"))
	c := connect(t, func(c *Config) { c.TLS = &tls.Config{RootCAs: roots} }, srv.Addr)
	if _, err := c.Echo(bg, nil, 8); err != nil {
		t.Fatal(err)
	}
	// Plain TCP to a TLS port never gets a Welcome.
	cfg := DefaultConfig()
	cfg.ConnectTimeout = 200 * time.Millisecond
	if _, err := dial(bg, &cfg, srv.Addr, nil); err == nil {
		t.Fatal("plain TCP was welcomed on the TLS port")
	}
}

// writePKI writes a CA and a server certificate for 127.0.0.1 signed by it
// (server.pem, server.key) into dir, and returns the CA as a pool.
func writePKI(t *testing.T, dir string) *x509.CertPool {
	t.Helper()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey, leafKey := key(), key()
	now := time.Now()
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvix test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &leafKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	pkcs8, _ := x509.MarshalPKCS8PrivateKey(leafKey)
	write := func(name, kind string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("server.pem", "CERTIFICATE", leafDER)
	write("server.key", "PRIVATE KEY", pkcs8)
	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	return pool
}
