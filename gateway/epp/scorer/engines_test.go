package scorer

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"

	kvix "github.com/kvix/kvix/client/go"
	"github.com/kvix/kvix/client/go/wire"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/scorer/prefix"
)

// The engine-fed shape: real vLLM 0.34 publishers (scripts/engines.py: the release's
// own ZmqEventPublisher) connect to kvix's --events-bind under llm-d's topic
// kv@<pod IP>@<model>, token ids come from transformers' apply_chat_template, and the
// pickers name endpoints by address ({address}{dp}), as kvix names engines that connect.

// python is the tests' interpreter (scripts/testenv.py), with the engines' wheels.
func python(t *testing.T) string { return pythonFor(t) }

func pythonFor(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("python3", "../../../scripts/testenv.py", "ensure").Output()
	if err != nil {
		t.Fatalf("the tests' Python (python3 scripts/testenv.py ensure, from the repository root): %v", err)
	}
	py := strings.TrimSpace(string(out))
	if out, err := exec.Command(py, "../../../scripts/engines.py", "setup").CombinedOutput(); err != nil {
		t.Fatalf("the engines' publishers (scripts/engines.py setup): %v\n%s", err, out)
	}
	return py
}

// lines is a child process spoken to one JSON line at a time.
type lines struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Scanner
	ready string // the first line it printed, "ready ..."
}

func start(t testing.TB, name string, args ...string) *lines {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Stderr = os.Stderr
	in, _ := cmd.StdinPipe()
	outPipe, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() })
	l := &lines{cmd: cmd, in: in, out: bufio.NewScanner(outPipe)}
	l.out.Buffer(nil, 16<<20)
	if l.ready = l.read(t); !strings.HasPrefix(l.ready, "ready") {
		t.Fatalf("%s %v: %q", name, args, l.ready)
	}
	return l
}

func (l *lines) read(t testing.TB) string {
	t.Helper()
	if !l.out.Scan() {
		t.Fatalf("%v stopped", l.cmd.Args)
	}
	return l.out.Text()
}

func (l *lines) ask(t testing.TB, v any) string {
	t.Helper()
	b, _ := json.Marshal(v)
	fmt.Fprintf(l.in, "%s\n", b)
	return l.read(t)
}

// engine is one vLLM rank: its real publisher and the blocks it holds.
type engine struct {
	pub  *lines
	held map[uint64]bool
}

// serve stores the whole blocks of a prompt the engine does not hold yet, as vLLM does:
// one BlockStored of the new blocks, chained to the last one held.
func (e *engine) serve(t *testing.T, tokens []uint32) {
	hashes := wire.TokenChain(0x5eed, 16, tokens) // the engine's own block hashes
	first := 0
	for first < len(hashes) && e.held[hashes[first]] {
		first++
	}
	if first == len(hashes) {
		return
	}
	var parent any
	if first > 0 {
		parent = hashes[first-1]
	}
	for _, h := range hashes[first:] {
		e.held[h] = true
	}
	e.pub.ask(t, map[string]any{"op": "publish", "events": []any{map[string]any{
		"type": "BlockStored", "block_hashes": hashes[first:], "parent_block_hash": parent,
		"token_ids": tokens[16*first : 16*len(hashes)], "block_size": 16, "lora_id": nil,
		"medium": "GPU", "lora_name": nil, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
	}}})
}

func freePorts(t *testing.T, n int) int {
	t.Helper()
	for try := 0; try < 100; try++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := l.Addr().(*net.TCPAddr).Port
		l.Close()
		ok := base+n < 65536
		for p := base + 1; ok && p < base+n; p++ {
			if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p)); err != nil {
				ok = false
			} else {
				l.Close()
			}
		}
		if ok {
			return base
		}
	}
	t.Fatal("no free ports")
	return 0
}

// engineFedConfig is the shipped configuration for engines that feed kvix their events:
// no announce, endpoints named by address, token ids from the tokenizer sidecar.
func engineFedConfig(t *testing.T, srv *testServer, tokenizer string) string {
	cfg := shippedConfig(t, srv)
	const announce = "    announce:\n      capacityBlocks: 1000000\n"
	if !strings.Contains(cfg, announce) {
		t.Fatal("config/epp-config.yaml has no announce block")
	}
	return strings.Replace(cfg, announce, "    workerName: \"{address}{dp}\"\n"+
		"    tokenizer: {url: \"http://"+tokenizer+"/tokenize\", timeoutMs: 5000}\n", 1)
}

// sidecar starts the tokenizer sidecar: its host:port.
func sidecar(t testing.TB, py string) string {
	t.Helper()
	l := start(t, py, "testdata/chat_tokenizer.py", "--http")
	return "127.0.0.1:" + strings.TrimPrefix(l.ready, "ready ")
}

// engineEndpoints are the four ranks at the engines' addresses (rank 1 of the last pod
// on port 8001).
func engineEndpoints(queue map[string]int) []fwksched.Endpoint {
	eps := endpoints(queue)
	for i, ep := range eps {
		m := ep.GetMetadata()
		m.Address = fmt.Sprintf("127.0.0.%d", 2+min(i, 2))
	}
	return eps
}

func TestEngineFedKvixScoresRealPublishersEventsOfRealChatTemplates(t *testing.T) {
	py := python(t)
	tok := start(t, py, "testdata/chat_tokenizer.py")
	events := freePorts(t, 4) // events +0, +1 (ranks); replay +2, +3
	srv := startServer(t, "--events-bind", fmt.Sprintf("tcp://127.0.0.1:%d", events),
		"--events-ranks", "2", "--events-replay-port", fmt.Sprint(events+2))
	engines := map[string]*engine{}
	for _, ep := range engineEndpoints(nil) {
		m := ep.GetMetadata()
		rank := strings.TrimPrefix(m.NamespacedName.Name[strings.LastIndex(m.NamespacedName.Name, "-rank-"):], "-rank-")
		pub := start(t, py, "../../../scripts/engines.py", "publish", "vllm-0.34.0",
			"--endpoint", fmt.Sprintf("tcp://127.0.0.1:%d", events),
			"--replay", fmt.Sprintf("tcp://%s:%d", m.Address, events+2),
			"--rank", rank, "--topic", "kv@"+m.Address+"@llama")
		engines[m.NamespacedName.Name] = &engine{pub: pub, held: map[uint64]bool{}}
	}
	// The engines are announced by their first message (a heartbeat here).
	probe, err := kvix.Connect(func() kvix.Config {
		c := kvix.DefaultConfig()
		c.Servers, c.Auth = []string{srv.Addr}, "epp-test-token"
		return c
	}())
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	eventually(t, "the four engines are announced", func() bool {
		for _, e := range engines {
			e.pub.ask(t, map[string]any{"op": "publish", "events": []any{}})
		}
		st, err := probe.Stats(context.Background())
		return err == nil && st.Workers == 4
	})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The engine tokenizes the request itself (the same template and tokenizer as the
	// pickers' sidecar), then stores the prompt's new blocks.
	serve := func(req *fwksched.LLMRequest, endpoint string) {
		var ids []uint32
		msgs, _ := json.Marshal(req.Body.ChatCompletions.Messages)
		if err := json.Unmarshal([]byte(tok.ask(t, json.RawMessage(msgs))), &ids); err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if id == 0 {
				t.Fatalf("the template rendered a word the tokenizer does not know: %v", ids)
			}
		}
		engines[endpoint].serve(t, ids)
	}
	run := func(pickers shape) float64 {
		return followUpHitWith(t, ctx, pickers, wordChat, nil, serve, engineEndpoints)
	}
	side := sidecar(t, py)
	var pickers []*epp
	kvixPicker := func() *epp {
		e := newEPP(t, ctx, engineFedConfig(t, srv, side), Type)
		pickers = append(pickers, e)
		return e
	}
	gaie := func() *epp { return newEPP(t, ctx, gaiePrefixConfig, prefix.PrefixCacheScorerPluginType) }
	kvixLeads(t, "engine-fed", run, kvixPicker, gaie)
	for _, e := range pickers {
		if n := e.kvix.TokenizerFailures(); n != 0 {
			t.Fatalf("%d requests scored without the sidecar's token ids", n)
		}
	}
	// What kvix scored came from the engines' events: every routed prompt's blocks.
	if stored := srv.Metric(t, `kvix_ingest_blocks_stored_total{medium="gpu"}`); stored < 100 {
		t.Fatalf("the engines' publishers stored %v blocks", stored)
	}
}

// BenchmarkTokenizerSidecar20k is what the scorer's call to the tokenizer sidecar costs
// for a chat of about 20,000 tokens (transformers' apply_chat_template and its fast
// tokenizer, in Python, over loopback HTTP).
func BenchmarkTokenizerSidecar20k(b *testing.B) {
	py := pythonFor(b)
	s := &Scorer{params: Params{Tokenizer: &Tokenizer{URL: "http://" + sidecar(b, py) + "/tokenize", TimeoutMs: 10_000}}}
	ctx := context.Background()
	req := wordChatLong(b, ctx, 20_000)
	ids, err := s.tokenize(ctx, req)
	if err != nil || len(ids) < 19_000 {
		b.Fatalf("%d ids, %v", len(ids), err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := s.tokenize(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(ids)), "tokens")
}
