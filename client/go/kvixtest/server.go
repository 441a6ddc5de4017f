// Package kvixtest runs real kvix-server processes for tests: the Go client's own, and
// those of gateways built on it.
package kvixtest

import (
	"bufio"
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
)

// Server is a kvix-server process, killed when its test ends.
type Server struct {
	Cmd     *exec.Cmd
	Addr    string // host:port of the kvix port
	Unix    string // "unix:/path", when --unix names one
	Metrics string // host:port of /metrics, when --metrics names one
}

// Binary is KVIX_SERVER_BIN, or the workspace's debug build found above the working
// directory. A missing binary fails the test naming the command that builds it.
func Binary(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv("KVIX_SERVER_BIN"); bin != "" {
		return bin
	}
	dir, _ := os.Getwd()
	for {
		bin := filepath.Join(dir, "target", "debug", "kvix-server")
		if _, err := os.Stat(bin); err == nil {
			return bin
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no kvix-server in target/debug above this directory: build it with `cargo build -p kvix-server` at the repository root, or set KVIX_SERVER_BIN")
		}
		dir = parent
	}
}

// Start starts kvix-server with args, waiting until it listens. Flags left out get
// test defaults: --listen 127.0.0.1:0, --unix "" (none), --metrics "" (none), --cores 1.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	s, err := TryStart(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// StartOn starts kvix-server listening on addr (a port a stopped server held),
// retrying while the port is still taken.
func StartOn(t testing.TB, addr string, args ...string) *Server {
	t.Helper()
	var last error
	for i := 0; i < 50; i++ {
		s, err := TryStart(t, append([]string{"--listen", addr}, args...)...)
		if err == nil {
			return s
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("kvix-server never listened on %s: %v", addr, last)
	return nil
}

// TryStart is Start, returning why a server did not start.
func TryStart(t testing.TB, args ...string) (*Server, error) {
	t.Helper()
	given := func(flag string) (string, bool) {
		i := slices.Index(args, flag)
		if i < 0 || i+1 >= len(args) {
			return "", false
		}
		return args[i+1], true
	}
	for _, d := range [][2]string{{"--listen", "127.0.0.1:0"}, {"--unix", ""}, {"--metrics", ""}, {"--cores", "1"}} {
		if _, ok := given(d[0]); !ok {
			args = append(args, d[0], d[1])
		}
	}
	unix, _ := given("--unix")
	metrics, _ := given("--metrics")
	cmd := exec.Command(Binary(t), args...)
	cmd.Env = append(os.Environ(), "KVIX_LOG=warn")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Server{Cmd: cmd}
	t.Cleanup(s.Stop)
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
	for s.Addr == "" || (unix != "" && s.Unix == "") || (metrics != "" && s.Metrics == "") {
		select {
		case line, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				return nil, fmt.Errorf("kvix-server exited before listening: %q", seen)
			}
			seen = append(seen, line)
			if _, rest, ok := strings.Cut(line, "listening on tcp://"); ok {
				s.Addr = strings.Fields(rest)[0]
			}
			if _, rest, ok := strings.Cut(line, "listening on unix://"); ok {
				s.Unix = "unix:" + strings.Fields(rest)[0]
			}
			if _, rest, ok := strings.Cut(line, "metrics on http://"); ok {
				s.Metrics = strings.TrimSuffix(strings.Fields(rest)[0], "/metrics")
			}
		case <-timeout:
			s.Stop()
			return nil, fmt.Errorf("kvix-server did not listen in 30 s: %q", seen)
		}
	}
	go func() {
		for range lines {
		}
	}()
	return s, nil
}

// Stop kills the server.
func (s *Server) Stop() { _ = s.Cmd.Process.Kill(); _ = s.Cmd.Wait() }

// Metric is the value of the sample named exactly name (labels included) on /metrics.
func (s *Server) Metric(t testing.TB, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + s.Metrics + "/metrics")
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

// Eventually polls cond until it holds, or fails the test after 30 s saying what.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("never: %s", what)
		}
	}
}
