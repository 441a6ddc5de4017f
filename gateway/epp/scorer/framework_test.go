package scorer

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr"
	kvix "github.com/kvix/kvix/client/go"
	"github.com/kvix/kvix/client/go/kvixtest"
	"github.com/prometheus/client_golang/prometheus"
	k8stypes "k8s.io/apimachinery/pkg/types"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/config/loader"
	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	fwkrc "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requestcontrol"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
	attrprefix "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/attribute/prefix"
	extractormetrics "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/extractor/metrics"
	sourcemetrics "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/source/metrics"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/flowcontrol/fairness"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/flowcontrol/ordering"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/flowcontrol/usagelimits"
	approxprefix "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/requesthandling/parsers/openai"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/picker"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/profile"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/scorer/prefix"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/scheduling/scorer/queuedepth"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling"
)

// The plugins the configurations name, registered as GAIE's runner registers them
// (its registerInTreePlugins is unexported), and kvix-scorer as cmd/kvix-epp does.
var register sync.Once

func registerPlugins() {
	register.Do(func() {
		ctrllog.SetLogger(logr.Discard())
		fwkplugin.Register(Type, Factory)
		fwkplugin.Register(ParserType, ParserFactory)
		fwkplugin.Register(prefix.PrefixCacheScorerPluginType, prefix.PrefixCachePluginFactory)
		fwkplugin.Register(prefixcacheaffinity.PluginType, prefixcacheaffinity.Factory)
		fwkplugin.Register(approxprefix.ApproxPrefixCachePluginType, approxprefix.ApproxPrefixCacheFactory)
		fwkplugin.Register(queuedepth.QueueScorerType, queuedepth.QueueScorerFactory)
		fwkplugin.Register(kvcacheutilization.KvCacheUtilizationScorerType, kvcacheutilization.KvCacheUtilizationScorerFactory)
		fwkplugin.Register(picker.MaxScorePickerType, picker.MaxScorePickerFactory)
		fwkplugin.Register(profile.SingleProfileHandlerType, profile.SingleProfileHandlerFactory)
		fwkplugin.Register(fairness.GlobalStrictFairnessPolicyType, fairness.GlobalStrictFairnessPolicyFactory)
		fwkplugin.Register(ordering.FCFSOrderingPolicyType, ordering.FCFSOrderingPolicyFactory)
		fwkplugin.Register(usagelimits.StaticUsageLimitPolicyType, usagelimits.StaticPolicyFactory)
		fwkplugin.Register(openai.OpenAIParserType, openai.OpenAIParserPluginFactory)
		fwkplugin.Register(utilization.UtilizationDetectorType, utilization.UtilizationDetectorFactory)
		fwkplugin.Register(sourcemetrics.MetricsDataSourceType, sourcemetrics.MetricsDataSourceFactory)
		fwkplugin.Register(extractormetrics.MetricsExtractorType, extractormetrics.CoreMetricsExtractorFactory)
	})
}

// epp is one endpoint picker: GAIE's loader, plugins and scheduler, driven the way
// its director drives them (PrepareRequestData, Schedule, PreRequest).
type epp struct {
	handle   fwkplugin.Handle
	sched    *scheduling.Scheduler
	prepare  []fwkrc.PrepareDataPlugin
	pre      []fwkrc.PreRequest
	affinity fwksched.Scorer
	kvix     *Scorer
}

func newEPP(t *testing.T, ctx context.Context, config, affinity string) *epp {
	t.Helper()
	registerPlugins()
	raw, _, err := loader.LoadRawConfig([]byte(config), logr.Discard())
	if err != nil {
		t.Fatalf("GAIE's loader refused the configuration: %v", err)
	}
	h := fwkplugin.NewEppHandle(ctx, func() []k8stypes.NamespacedName { return nil })
	cfg, err := loader.InstantiateAndConfigure(raw, h, logr.Discard())
	if err != nil {
		t.Fatalf("GAIE could not instantiate the configuration: %v", err)
	}
	e := &epp{handle: h, sched: scheduling.NewSchedulerWithConfig(cfg.SchedulerConfig)}
	for _, p := range h.GetAllPlugins() {
		if pd, ok := p.(fwkrc.PrepareDataPlugin); ok {
			e.prepare = append(e.prepare, pd)
		}
		if pr, ok := p.(fwkrc.PreRequest); ok {
			e.pre = append(e.pre, pr)
		}
		if s, ok := p.(*Scorer); ok {
			e.kvix = s
		}
	}
	if e.kvix != nil {
		eventually(t, "the scorer connects to kvix", e.kvix.Client().Connected)
	}
	e.affinity, _ = h.Plugin(affinity).(fwksched.Scorer)
	if e.affinity == nil {
		t.Fatalf("no scorer %q in the configuration", affinity)
	}
	return e
}

// route schedules req and tells the plugins where it went: the chosen endpoint's name.
func (e *epp) route(t *testing.T, ctx context.Context, req *fwksched.LLMRequest, eps []fwksched.Endpoint) string {
	t.Helper()
	for _, pd := range e.prepare {
		if err := pd.PrepareRequestData(ctx, req, eps); err != nil {
			t.Fatal(err)
		}
	}
	res, err := e.sched.Schedule(ctx, req, eps)
	if err != nil {
		t.Fatalf("Schedule: %v", err)
	}
	for _, pr := range e.pre {
		pr.PreRequest(ctx, req, res)
	}
	return res.ProfileResults[res.PrimaryProfileName].TargetEndpoints[0].GetMetadata().NamespacedName.Name
}

// affinityOf is the affinity scorer's score of each endpoint for a repeat of req.
func (e *epp) affinityOf(t *testing.T, ctx context.Context, req *fwksched.LLMRequest, eps []fwksched.Endpoint) map[string]float64 {
	probe := *req
	probe.RequestId = req.RequestId + "-probe"
	for _, pd := range e.prepare {
		_ = pd.PrepareRequestData(ctx, &probe, eps)
	}
	out := map[string]float64{}
	for ep, s := range e.affinity.Score(ctx, fwksched.NewCycleState(), &probe, eps) {
		out[ep.GetMetadata().NamespacedName.Name] = s
	}
	return out
}

// endpoints are four vLLM endpoints as GAIE's datastore makes them: three pods, the
// last with a second data-parallel rank on port 8001; queue is each one's waiting queue.
func endpoints(queue map[string]int) []fwksched.Endpoint {
	var out []fwksched.Endpoint
	for i, ep := range []struct{ pod, port, rank string }{
		{"vllm-0", "8000", "0"}, {"vllm-1", "8000", "0"}, {"vllm-2", "8000", "0"}, {"vllm-2", "8001", "1"},
	} {
		name := ep.pod + "-rank-" + ep.rank
		meta := &fwkdl.EndpointMetadata{NamespacedName: k8stypes.NamespacedName{Namespace: "serving", Name: name},
			PodName: ep.pod, Address: fmt.Sprintf("10.0.0.%d", i/3*0+i+1), Port: ep.port}
		out = append(out, fwksched.NewEndpoint(meta, &fwkdl.Metrics{WaitingQueueSize: queue[name]}, nil))
	}
	return out
}

// chat is turn k of conversation c: a system prompt of 2,400 characters (instructions
// and retrieved context), k earlier exchanges, a question. Each turn adds about 400
// characters, so a follow-up shares at least 3/4 of its prompt with the turn before:
// with less, the shipped weights let an idle endpoint outbid the holder (3 x share
// against 2 x a queue score of 1) under either affinity scorer.
func chat(t *testing.T, ctx context.Context, c, k int) *fwksched.LLMRequest {
	return conversation(t, ctx, c, k,
		fmt.Sprintf("Conversation %d. ", c)+strings.Repeat("You are a careful assistant for the kvix routing test. ", 44),
		func(i int) string {
			return fmt.Sprintf("Question %d of conversation %d: %s", i, c, strings.Repeat("explain prefix caching once more. ", 4))
		},
		func(i int) string {
			return fmt.Sprintf("Answer %d: %s", i, strings.Repeat("blocks are reused when the prefix matches. ", 5))
		})
}

// wordChat is chat in the words of the test tokenizer (testdata/chat_tokenizer.py: word
// "w<n>" is one token): a system prompt of 400 tokens, exchanges of 40 and 50.
func wordChat(t *testing.T, ctx context.Context, c, k int) *fwksched.LLMRequest {
	words := func(seed, n int) string {
		w := make([]string, n)
		for i := range w {
			w[i] = fmt.Sprintf("w%d", (seed*7919+i*104729)%50_000)
		}
		return strings.Join(w, " ")
	}
	return conversation(t, ctx, c, k, words(c, 400),
		func(i int) string { return words(c*100+i+1, 40) },
		func(i int) string { return words(c*100+i+51, 50) })
}

// wordChatLong is one chat of about n tokens of the test tokenizer.
func wordChatLong(t testing.TB, ctx context.Context, n int) *fwksched.LLMRequest {
	w := make([]string, n-10)
	for i := range w {
		w[i] = fmt.Sprintf("w%d", i*104729%50_000)
	}
	return conversation(t, ctx, 0, 0, strings.Join(w, " "),
		func(int) string { return "w1 w2 w3" }, func(int) string { return "" })
}

// conversation is turn k of conversation c: system, k earlier exchanges, a question.
func conversation(t testing.TB, ctx context.Context, c, k int, system string, question, answer func(int) string) *fwksched.LLMRequest {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []msg{{"system", system}}
	for i := 0; i <= k; i++ {
		msgs = append(msgs, msg{"user", question(i)})
		if i < k {
			msgs = append(msgs, msg{"assistant", answer(i)})
		}
	}
	body, _ := json.Marshal(map[string]any{"model": "llama", "messages": msgs})
	parsed, err := openai.NewOpenAIParser().ParseRequest(ctx, body, map[string]string{":path": "/v1/chat/completions"})
	if err != nil {
		t.Fatal(err)
	}
	return &fwksched.LLMRequest{RequestId: fmt.Sprintf("c%d-t%d", c, k), TargetModel: "llama", Body: parsed}
}

const conversations, turns = 50, 4

// followUpHit routes every turn of every conversation through the pickers, placement-fed.
func followUpHit(t *testing.T, ctx context.Context, pickers shape) float64 {
	return followUpHitWith(t, ctx, pickers, chat, nil, nil, endpoints)
}

// shape says which picker routes turn k of conversation c.
type shape func(c, k int) *epp

// alternating sends turn k of conversation c to picker (c + k) mod pickers:
// consecutive turns of one conversation go to different replicas when there are two.
func alternating(pickers ...*epp) shape {
	return func(c, k int) *epp { return pickers[(c+k)%len(pickers)] }
}

// rolled is one picker at a time: before, then from turn at on a fresh one (after), as
// a rolling update of a single EPP replaces it.
func rolled(at int, before, after *epp) shape {
	return func(_, k int) *epp {
		if k < at {
			return before
		}
		return after
	}
}

// runs numbers the conversations of each followUpHitWith call apart, so that engines
// that served one run hold nothing of the next.
var runs int

// followUpHitWith routes every turn of every conversation (made by turn), turn by turn,
// through the pickers the shape names, and returns the share of follow-up turns routed
// to the endpoint that served the conversation's turn before. prepare (tokenizing)
// runs before a request is routed, serve (an engine storing its prompt) after; either
// may be nil.
func followUpHitWith(t *testing.T, ctx context.Context, pickers shape,
	turn func(*testing.T, context.Context, int, int) *fwksched.LLMRequest,
	prepare func(*fwksched.LLMRequest), serve func(*fwksched.LLMRequest, string),
	eps func(map[string]int) []fwksched.Endpoint) float64 {
	runs++
	served := map[int]string{}
	queue := map[string]int{}
	var recent []string
	hits, followUps := 0, 0
	for k := 0; k < turns; k++ {
		for c := 0; c < conversations; c++ {
			e := pickers(c, k)
			req := turn(t, ctx, runs*1000+c, k)
			if prepare != nil {
				prepare(req)
			}
			target := e.route(t, ctx, req, eps(queue))
			if serve != nil {
				serve(req, target)
			}
			if k > 0 {
				followUps++
				if served[c] == target {
					hits++
				}
			}
			served[c] = target
			// The last 8 requests are in flight: each endpoint's queue is its share.
			recent = append(recent, target)
			queue[target]++
			if len(recent) > 8 {
				queue[recent[0]]--
				recent = recent[1:]
			}
			// The picker's record of this request is applied before the next one.
			eventually(t, "the record of "+req.RequestId+" is seen", func() bool {
				return e.affinityOf(t, ctx, req, eps(queue))[target] > 0.99
			})
		}
	}
	return float64(hits) / float64(followUps)
}

var eventually = kvixtest.Eventually

// shippedConfig is config/epp-config.yaml pointed at srv and its token.
func shippedConfig(t *testing.T, srv *testServer) string {
	b, err := os.ReadFile("../config/epp-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const servers = `["kvix-0.kvix:7420", "kvix-1.kvix:7420", "kvix-2.kvix:7420"]`
	if !strings.Contains(string(b), servers) {
		t.Fatalf("config/epp-config.yaml does not name %s", servers)
	}
	// The tests count routing, not time: a query past the shipped 2 ms on a loaded
	// test machine would fail open and route by load alone.
	if !strings.Contains(string(b), "deadlineMs: 2\n") {
		t.Fatal("config/epp-config.yaml has no deadlineMs: 2")
	}
	const token = "authTokenFile: /etc/kvix-auth/token\n"
	if !strings.Contains(string(b), token) {
		t.Fatal("config/epp-config.yaml reads no token from /etc/kvix-auth/token")
	}
	cfg := strings.ReplaceAll(string(b), servers, `["`+srv.Addr+`"]`)
	cfg = strings.ReplaceAll(cfg, token, "authTokenFile: "+srv.tokenFile+"\n")
	return strings.ReplaceAll(cfg, "deadlineMs: 2\n", "deadlineMs: 5000\n")
}

// GAIE's own prefix-cache scorer in the same place as kvix-scorer in the shipped
// configuration (its approximate prefix producer feeding the same filter).
const gaiePrefixConfig = `apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {autoTune: false, blockSizeTokens: 16, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250}
- type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.8
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: max-score-picker
`

func TestKvixScorerInGAIEsSchedulerSharesOneViewAcrossReplicas(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := startServer(t)
	kvix := func() *epp { return newEPP(t, ctx, shippedConfig(t, srv), Type) }
	gaie := func() *epp { return newEPP(t, ctx, gaiePrefixConfig, prefix.PrefixCacheScorerPluginType) }
	kvixLeads(t, "placement-fed", func(s shape) float64 { return followUpHit(t, ctx, s) }, kvix, gaie)
}

// hits is the follow-up hit of a run whose turns the shape routes.
type hits func(shape) float64

// kvixLeads measures the follow-up hit of kvix's pickers and of GAIE's prefix scorer
// in three shapes: one EPP, two active EPPs, one EPP replaced by a rolling update
// halfway. Two EPPs sharing kvix, and an EPP rolled, hit within 0.01 of one; kvix
// hits at least GAIE's with one EPP, 0.2 above GAIE's per-replica index with two, and
// 0.1 above it across the roll (a fresh GAIE picker has forgotten every placement).
func kvixLeads(t *testing.T, feed string, run hits, kvix, gaie func() *epp) {
	t.Helper()
	kvixOne, kvixTwo, kvixRolled := run(alternating(kvix())), run(alternating(kvix(), kvix())), run(rolled(turns/2, kvix(), kvix()))
	gaieOne, gaieTwo, gaieRolled := run(alternating(gaie())), run(alternating(gaie(), gaie())), run(rolled(turns/2, gaie(), gaie()))
	t.Logf("%s, follow-up hit over %d follow-ups: kvix one EPP %.3f, two EPPs %.3f, one EPP rolled %.3f; GAIE prefix-cache-scorer one EPP %.3f, two EPPs %.3f, one EPP rolled %.3f",
		feed, conversations*(turns-1), kvixOne, kvixTwo, kvixRolled, gaieOne, gaieTwo, gaieRolled)
	if kvixOne < gaieOne {
		t.Errorf("kvix (%.3f) below GAIE's prefix scorer (%.3f) with one EPP", kvixOne, gaieOne)
	}
	for _, c := range []struct {
		shape string
		hit   float64
	}{{"two EPPs sharing kvix", kvixTwo}, {"an EPP rolled", kvixRolled}} {
		if c.hit < kvixOne-0.01 {
			t.Errorf("%s hit %.3f, one EPP %.3f: more than 0.01 apart", c.shape, c.hit, kvixOne)
		}
	}
	if kvixTwo < gaieTwo+0.2 {
		t.Errorf("two EPPs: kvix %.3f does not beat GAIE's per-replica prefix scorer %.3f by 0.2", kvixTwo, gaieTwo)
	}
	if kvixRolled < gaieRolled+0.1 {
		t.Errorf("an EPP rolled: kvix %.3f does not beat GAIE's prefix scorer %.3f by 0.1", kvixRolled, gaieRolled)
	}
}

func TestWithKvixStoppedSchedulingGoesOnWithoutItAndMetricsSaySo(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := startServer(t)
	// A name of its own: the collector reports every live scorer by its name.
	cfg := strings.Replace(shippedConfig(t, srv), "- type: kvix-scorer\n", "- type: kvix-scorer\n  name: kvix-stopped\n", 1)
	cfg = strings.Replace(cfg, "pluginRef: kvix-scorer\n", "pluginRef: kvix-stopped\n", 1)
	e := newEPP(t, ctx, cfg, "kvix-stopped")
	eventually(t, "the scorer connects", e.kvix.Client().Connected)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(Collector())
	if got := scraped(t, reg, "kvix_epp_connected", "kvix-stopped", ""); got != 1 {
		t.Fatalf("kvix_epp_connected %v while connected", got)
	}
	srv.Stop()
	eventually(t, "the scorer sees kvix gone", func() bool { return !e.kvix.Client().Connected() })
	for c := 0; c < 10; c++ {
		if target := e.route(t, ctx, chat(t, ctx, c, 1), endpoints(nil)); target == "" {
			t.Fatal("no endpoint picked")
		}
	}
	n := e.kvix.Client().Counters()
	if n.Outcomes[kvix.ReasonDisconnected] != 10 {
		t.Fatalf("queries while kvix is down: %+v", n.Outcomes)
	}
	// The EPP's /metrics says it: every query failed open, the scorer is disconnected.
	if got := scraped(t, reg, "kvix_epp_queries_total", "kvix-stopped", "disconnected"); got != 10 {
		t.Fatalf("kvix_epp_queries_total{outcome=disconnected} %v, want 10", got)
	}
	if got := scraped(t, reg, "kvix_epp_connected", "kvix-stopped", ""); got != 0 {
		t.Fatalf("kvix_epp_connected %v with kvix stopped", got)
	}
}

// scraped is the value of the series name{plugin, outcome} (outcome "" for none) that
// reg gathers.
func scraped(t *testing.T, reg *prometheus.Registry, name, plugin, outcome string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["plugin"] == plugin && labels["outcome"] == outcome {
				if m.GetCounter() != nil {
					return m.GetCounter().GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no series %s{plugin=%q, outcome=%q}", name, plugin, outcome)
	return 0
}

// The EPP's alert rules use only series the collector exports.
func TestTheEPPAlertRulesUseTheScorersMetrics(t *testing.T) {
	rules, err := os.ReadFile("../../../deploy/prometheus/kvix-epp-alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	described := map[string]bool{}
	ch := make(chan *prometheus.Desc, 32)
	Collector().Describe(ch)
	close(ch)
	for d := range ch {
		described[regexp.MustCompile(`fqName: "([a-z_]+)"`).FindStringSubmatch(d.String())[1]] = true
	}
	used := regexp.MustCompile(`kvix_epp_[a-z_]+`).FindAllString(string(rules), -1)
	if len(used) < 3 {
		t.Fatalf("the rules use %v", used)
	}
	for _, name := range used {
		if !described[name] {
			t.Errorf("deploy/prometheus/kvix-epp-alerts.yml uses %s, which the scorer does not export (%v)", name, described)
		}
	}
}

// GAIE's own prefix-cache-affinity-filter reads kvix's answer: the follow-up of a
// conversation is narrowed to the endpoint that served it.
func TestGAIEsAffinityFilterReadsKvixsAnswer(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := startServer(t)
	e := newEPP(t, ctx, shippedConfig(t, srv), Type)
	first := chat(t, ctx, 7, 0)
	target := e.route(t, ctx, first, endpoints(nil))
	eventually(t, "the placement is seen", func() bool { return e.affinityOf(t, ctx, first, endpoints(nil))[target] > 0.99 })
	filter, ok := e.handle.Plugin(prefixcacheaffinity.PluginType).(fwksched.Filter)
	if !ok {
		t.Fatal("the shipped configuration has no prefix-cache-affinity-filter")
	}
	eps := endpoints(nil)
	follow := chat(t, ctx, 7, 1)
	if err := e.kvix.PrepareRequestData(ctx, follow, eps); err != nil {
		t.Fatal(err)
	}
	for _, ep := range eps {
		raw, ok := ep.Get(attrprefix.PrefixCacheMatchInfoKey)
		if !ok {
			t.Fatalf("%s: no PrefixCacheMatchInfo", ep.GetMetadata().NamespacedName.Name)
		}
		info := raw.(*attrprefix.PrefixCacheMatchInfo)
		held := ep.GetMetadata().NamespacedName.Name == target
		if share := float64(info.MatchBlocks()) / float64(info.TotalBlocks()); (share >= 0.8) != held {
			t.Errorf("%s: kvix's match %d of %d blocks (served the first turn: %v)",
				ep.GetMetadata().NamespacedName.Name, info.MatchBlocks(), info.TotalBlocks(), held)
		}
	}
	// The filter skips its gate one request in a hundred (exploration): count.
	narrowed := 0
	for i := 0; i < 50; i++ {
		kept := filter.Filter(ctx, fwksched.NewCycleState(), follow, eps)
		switch {
		case len(kept) == 1 && kept[0].GetMetadata().NamespacedName.Name == target:
			narrowed++
		case len(kept) != len(eps):
			t.Fatalf("the filter kept %d endpoints", len(kept))
		}
	}
	if narrowed < 45 {
		t.Fatalf("the filter narrowed to %s %d times in 50", target, narrowed)
	}
}

func TestEndpointsMapToKvixWorkerNames(t *testing.T) {
	s := &Scorer{params: Params{WorkerName: "{pod}{dp}"}}
	for _, tc := range []struct {
		meta EndpointMeta
		want string
	}{
		{EndpointMeta{Name: "vllm-0-rank-0", Pod: "vllm-0"}, "vllm-0"},
		{EndpointMeta{Name: "vllm-2-rank-1", Pod: "vllm-2"}, "vllm-2/dp1"},
		{EndpointMeta{Name: "plain", Pod: "plain"}, "plain"},
	} {
		if got := s.WorkerName(&tc.meta); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.meta, got, tc.want)
		}
	}
	s.params.WorkerName = "{namespace}/{address}:{port}#{rank}"
	if got := s.WorkerName(&EndpointMeta{Name: "p-rank-3", Namespace: "ns", Address: "10.0.0.9", Port: "8003"}); got != "ns/10.0.0.9:8003#3" {
		t.Errorf("template: %q", got)
	}
}

func TestBadParametersAreRefusedNamingTheField(t *testing.T) {
	for _, tc := range []struct{ params, want string }{
		{`{}`, "servers"},
		{`{"servers": ["x:1"], "nope": 1}`, "nope"},
		{`{"servers": ["x:1"], "announce": {"capacityBlocks": 0}}`, "capacityBlocks"},
		{`{"servers": ["x:1"], "authTokenFile": "/nonexistent"}`, "authTokenFile"},
	} {
		_, err := Factory("k", json.RawMessage(tc.params), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v", tc.params, err)
		}
	}
}

// testServer is a real kvix-server (kvixtest) requiring a token, which tokenFile holds.
type testServer struct {
	*kvixtest.Server
	tokenFile string
}

// startServer starts kvix-server with its metrics port, requiring a token, and args.
func startServer(t *testing.T, args ...string) *testServer {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("epp-test-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := kvixtest.Start(t, append([]string{"--metrics", "127.0.0.1:0", "--auth-token-file", tokenFile}, args...)...)
	return &testServer{Server: s, tokenFile: tokenFile}
}
