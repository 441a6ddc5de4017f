package kvix

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvix/kvix/client/go/wire"
)

// testServer is a real kvix-server process: KVIX_SERVER_BIN, or the workspace's debug
// build. A missing binary fails the test naming the command that builds it.
type testServer struct {
	cmd     *exec.Cmd
	addr    string // host:port
	unix    string // unix:/path, when asked for
	metrics string // host:port of /metrics, when --metrics was given
}

func serverBin(t testing.TB) string {
	if bin := os.Getenv("KVIX_SERVER_BIN"); bin != "" {
		return bin
	}
	bin, _ := filepath.Abs("../../target/debug/kvix-server")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no kvix-server at %s: build it with `cargo build -p kvix-server` at the repository root, or set KVIX_SERVER_BIN", bin)
	}
	return bin
}

// startServerOn starts kvix-server listening on addr (a port a stopped server held),
// retrying while the port is still taken.
func startServerOn(t testing.TB, addr string, args ...string) *testServer {
	t.Helper()
	var last error
	for i := 0; i < 50; i++ {
		s, err := tryStart(t, false, append([]string{"--listen", addr}, args...))
		if err == nil {
			return s
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("kvix-server never listened on %s: %v", addr, last)
	return nil
}

// startServer starts kvix-server with args on an ephemeral port (and a Unix socket
// when unix), waiting until it listens. It is killed when the test ends.
func startServer(t testing.TB, unix bool, args ...string) *testServer {
	t.Helper()
	s, err := tryStart(t, unix, append([]string{"--listen", "127.0.0.1:0"}, args...))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func tryStart(t testing.TB, unix bool, args []string) (*testServer, error) {
	sock := ""
	if unix {
		sock = filepath.Join(t.TempDir(), "kvix.sock")
	}
	wantMetrics := slices.Contains(args, "--metrics")
	all := append([]string{"--unix", sock, "--cores", "1"}, args...)
	if !wantMetrics {
		all = append(all, "--metrics", "")
	}
	cmd := exec.Command(serverBin(t), all...)
	cmd.Env = append(os.Environ(), "KVIX_LOG=warn")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &testServer{cmd: cmd}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	timeout := time.After(30 * time.Second)
	var seen []string
	for s.addr == "" || (unix && s.unix == "") || (wantMetrics && s.metrics == "") {
		select {
		case line, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				return nil, fmt.Errorf("kvix-server exited before listening: %q", seen)
			}
			seen = append(seen, line)
			if _, rest, ok := strings.Cut(line, "listening on tcp://"); ok {
				s.addr = strings.Fields(rest)[0]
			}
			if _, rest, ok := strings.Cut(line, "listening on unix://"); ok {
				s.unix = "unix:" + strings.Fields(rest)[0]
			}
			if _, rest, ok := strings.Cut(line, "metrics on http://"); ok {
				s.metrics = strings.TrimSuffix(strings.Fields(rest)[0], "/metrics")
			}
		case <-timeout:
			return nil, fmt.Errorf("kvix-server did not listen in 30 s: %q", seen)
		}
	}
	go func() {
		for range lines {
		}
	}()
	return s, nil
}

func (s *testServer) stop() { _ = s.cmd.Process.Kill(); _ = s.cmd.Wait() }

// metric is the value of the sample named exactly name (with its labels) on /metrics.
func (s *testServer) metric(t testing.TB, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + s.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	t.Fatalf("no %s on /metrics", name)
	return 0
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

// eventually polls cond until it holds, or fails after 30 s saying what.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("never: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

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

// statsOf asks this server for its Stats through a connection of c's config.
func (s *testServer) statsOf(c *Client) (*wire.Stats, error) {
	cn, err := dial(bg, &c.cfg, s.addr, nil)
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
