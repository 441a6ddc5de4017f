// Package scorer is kvix as a scorer of the Gateway API Inference Extension's endpoint
// picker (GAIE v1.5.0): it scores each candidate endpoint by the prefix of the
// request's prompt the worker behind it can reuse, as one kvix index shared by every
// EPP replica says, and tells kvix where each request went.
//
// Plugin type "kvix-scorer". It is a data producer (PrepareRequestData: kvix's answer
// as GAIE's PrefixCacheMatchInfo on every endpoint, which GAIE's own prefix consumers
// read, such as its prefix-cache-affinity-filter), a Scorer (category Affinity), a
// PreRequest plugin (the placement) and a ResponseBody plugin (the engine's reported
// reuse, back to kvix): list it under plugins: and reference it from a scheduling
// profile with a weight. Its parameters are Params. The reuse reports need the
// kvix-openai-parser (ParserType) as the configuration's parser. Leave GAIE's
// approximate prefix producer out of a configuration that has kvix-scorer: both put
// the same data on the endpoints.
package scorer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	kvix "github.com/kvix/kvix/client/go"
	"github.com/kvix/kvix/client/go/wire"
	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	fwkrc "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requestcontrol"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
	attrprefix "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/attribute/prefix"
)

// Type is the plugin type to name in an EndpointPickerConfig.
const Type = "kvix-scorer"

// Params are the plugin's parameters in the EndpointPickerConfig.
type Params struct {
	// Servers are kvix-server addresses ("host:port" or "unix:/path"), in order of preference.
	Servers []string `json:"servers"`
	// Replicas: the servers share one write log (kvix-server --log).
	Replicas bool `json:"replicas,omitempty"`
	// AuthTokenFile holds the servers' --auth-token, when they require one.
	AuthTokenFile string `json:"authTokenFile,omitempty"`
	// TokenBlock must equal the servers' --block-size. Default 16.
	TokenBlock uint32 `json:"tokenBlock,omitempty"`
	// DeadlineMs bounds a query; past it the scorer fails open (every endpoint 0) and
	// the other scorers decide. Default 2.
	DeadlineMs float64 `json:"deadlineMs,omitempty"`
	// CPUWeight and StorageWeight: what reuse from CPU memory and from storage is worth
	// against GPU. Default Dynamo's 0.75 and 0.25.
	CPUWeight     *float32 `json:"cpuWeight,omitempty"`
	StorageWeight *float32 `json:"storageWeight,omitempty"`
	// WorkerName maps an endpoint to the kvix worker name its engine is known by:
	// {pod}, {namespace}, {address}, {port}, {rank} (the data-parallel rank of GAIE's
	// "<pod>-rank-<n>" endpoints) and {dp} ("" for rank 0, "/dp<rank>" otherwise:
	// kvix's own name for engine ranks). Default "{pod}{dp}".
	WorkerName string `json:"workerName,omitempty"`
	// Tokenizer, when set, is a tokenizer sidecar speaking vLLM's POST /tokenize (vLLM
	// itself, or a process running the model's tokenizer and chat template): a request
	// without token ids (no tokenizer plugin set GAIE's TokenizedPrompt) is tokenized
	// there, so that engine-fed workers match it.
	Tokenizer *Tokenizer `json:"tokenizer,omitempty"`
	// Announce, when set, has the scorer announce every endpoint it sees as a worker
	// fed by placements (the shared approximate mode: no engine events needed). Leave
	// it unset when the engines feed kvix their KV events.
	Announce *Announce `json:"announce,omitempty"`
}

// Tokenizer is a tokenizer sidecar.
type Tokenizer struct {
	// URL of its /tokenize (vLLM's API: {"model", "messages" | "prompt"} answered with
	// {"tokens": [...]}).
	URL string `json:"url"`
	// TimeoutMs bounds a call; past it the request is scored without token ids. Default 50.
	TimeoutMs float64 `json:"timeoutMs,omitempty"`
}

// Announce says how endpoints announced by the scorer keep their placements.
type Announce struct {
	CapacityBlocks uint64 `json:"capacityBlocks"`
	TTLMs          uint64 `json:"ttlMs,omitempty"`
}

// Scorer is the kvix-scorer plugin.
type Scorer struct {
	typedName fwkplugin.TypedName
	params    Params
	client    *kvix.Client
	weights   wire.TierWeights

	tokenizerFailures atomic.Uint64

	mu        sync.Mutex
	announced map[string]bool
	// requests holds each scored request until its response ends (or [kept]).
	requests map[string]*scored
	swept    time.Time
}

type scored struct {
	ks        wire.Keyspace
	chain     []uint64           // until placed
	blocks    int                // the chain's length
	tokens    bool               // the chain is of the engine's token ids
	predicted map[string]float64 // blocks reusable, by worker; nil when kvix did not answer
	reuse     map[string]float64 // the same weighed by tier and doubt, in GPU blocks
	worker    string             // where it went (PreRequest)
	at        time.Time
}

var (
	_ fwkrc.PrepareDataPlugin = (*Scorer)(nil)
	_ fwksched.Scorer         = (*Scorer)(nil)
	_ fwkrc.PreRequest        = (*Scorer)(nil)
	_ fwkrc.ResponseBody      = (*Scorer)(nil)
)

// Factory builds the plugin from its EndpointPickerConfig entry.
func Factory(name string, raw json.RawMessage, handle fwkplugin.Handle) (fwkplugin.Plugin, error) {
	var p Params
	if len(raw) > 0 {
		dec := json.NewDecoder(strings.NewReader(string(raw)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return nil, fmt.Errorf("%s %q: parameters: %w", Type, name, err)
		}
	}
	s, err := New(p)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", Type, name, err)
	}
	s.typedName.Name = name
	track(s, true)
	if handle != nil {
		go func() { <-handle.Context().Done(); s.Close() }()
	}
	return s, nil
}

// New connects a scorer to the kvix servers of p (in the background: scoring fails
// open until one is up).
func New(p Params) (*Scorer, error) {
	cfg := kvix.DefaultConfig()
	if len(p.Servers) == 0 {
		return nil, errors.New("servers: at least one kvix-server address is needed")
	}
	cfg.Servers, cfg.Replicas, cfg.Name = p.Servers, p.Replicas, "kvix-epp"
	if p.TokenBlock != 0 {
		cfg.TokenBlock = p.TokenBlock
	}
	if p.DeadlineMs != 0 {
		cfg.Deadline = time.Duration(p.DeadlineMs * float64(time.Millisecond))
	}
	if p.CPUWeight != nil {
		cfg.Weights.CPU = *p.CPUWeight
	}
	if p.StorageWeight != nil {
		cfg.Weights.Storage = *p.StorageWeight
	}
	if p.AuthTokenFile != "" {
		b, err := os.ReadFile(p.AuthTokenFile)
		if err != nil {
			return nil, fmt.Errorf("authTokenFile: %w", err)
		}
		cfg.Auth = strings.TrimSpace(string(b))
	}
	if p.WorkerName == "" {
		p.WorkerName = "{pod}{dp}"
	}
	if p.Announce != nil && p.Announce.CapacityBlocks == 0 {
		return nil, errors.New("announce.capacityBlocks: must be positive")
	}
	if t := p.Tokenizer; t != nil {
		if u, err := url.Parse(t.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, fmt.Errorf("tokenizer.url: %q is not an http(s) URL", t.URL)
		}
		if t.TimeoutMs == 0 {
			t.TimeoutMs = 50
		}
	}
	client, err := kvix.Connect(cfg)
	if err != nil {
		return nil, err
	}
	s := &Scorer{typedName: fwkplugin.TypedName{Type: Type, Name: Type}, params: p, client: client,
		weights: cfg.Weights, announced: map[string]bool{}, requests: map[string]*scored{}}
	return s, nil
}

// Close disconnects from kvix.
func (s *Scorer) Close() {
	track(s, false)
	s.client.Close()
}

// Client is the scorer's kvix client (its counters say how queries went).
func (s *Scorer) Client() *kvix.Client { return s.client }

// TypedName is the plugin's type and name.
func (s *Scorer) TypedName() fwkplugin.TypedName { return s.typedName }

// Category: kvix scores cache locality.
func (s *Scorer) Category() fwksched.ScorerCategory { return fwksched.Affinity }

// WorkerName is the kvix worker name of an endpoint.
func (s *Scorer) WorkerName(m *EndpointMeta) string {
	rank, dp := "0", ""
	if i := strings.LastIndex(m.Name, "-rank-"); i >= 0 {
		rank = m.Name[i+len("-rank-"):]
		if rank != "0" {
			dp = "/dp" + rank
		}
	}
	return strings.NewReplacer("{pod}", m.Pod, "{namespace}", m.Namespace, "{address}", m.Address,
		"{port}", m.Port, "{rank}", rank, "{dp}", dp).Replace(s.params.WorkerName)
}

// EndpointMeta is what of an endpoint's metadata names its worker.
type EndpointMeta struct{ Name, Namespace, Pod, Address, Port string }

func metaOf(e fwksched.Endpoint) *EndpointMeta {
	m := e.GetMetadata()
	pod := m.PodName
	if pod == "" {
		pod = m.NamespacedName.Name
	}
	return &EndpointMeta{Name: m.NamespacedName.Name, Namespace: m.NamespacedName.Namespace, Pod: pod,
		Address: m.Address, Port: m.Port}
}

// prompt is the keyspace and chain of a request: the engine's token ids when a
// tokenizer plugin set them (engine-fed workers match those), else the bytes of the
// prompt as GAIE's parser holds it (matching the placements the scorer itself made).
func (s *Scorer) prompt(ctx context.Context, req *fwksched.LLMRequest) (wire.Keyspace, []uint64, bool) {
	salt := ""
	if req.Body != nil {
		salt = req.Body.CacheSalt()
	}
	if req.TokenizedPrompt != nil && len(req.TokenizedPrompt.TokenIDs) > 0 {
		ks := wire.Keyspace{Model: req.TargetModel, Salt: salt}
		return ks, s.client.TokenChain(ks, req.TokenizedPrompt.TokenIDs), true
	}
	if ids, err := s.tokenize(ctx, req); err == nil {
		ks := wire.Keyspace{Model: req.TargetModel, Salt: salt}
		return ks, s.client.TokenChain(ks, ids), true
	} else if !errors.Is(err, errNoTokenizer) {
		s.tokenizerFailures.Add(1)
	}
	if req.Body == nil {
		return wire.Keyspace{}, nil, false
	}
	var text []byte
	if c := req.Body.ChatCompletions; c != nil {
		text, _ = json.Marshal(c.Messages)
	} else {
		text = []byte(req.Body.PromptText())
	}
	ks := wire.Keyspace{Model: req.TargetModel, Salt: salt, Kind: wire.ChunkBytes}
	return ks, s.client.ByteChain(ks, text), true
}

// Produces: kvix's answer, as GAIE's prefix data.
func (s *Scorer) Produces() map[string]any {
	return map[string]any{attrprefix.PrefixCacheMatchInfoKey: attrprefix.PrefixCacheMatchInfo{}}
}

// Consumes nothing another plugin produces.
func (s *Scorer) Consumes() map[string]any { return map[string]any{} }

// PrepareRequestData asks kvix, once per request, what each endpoint's worker can
// reuse of the prompt and puts it on the endpoint as GAIE's PrefixCacheMatchInfo
// (blocks weighed by tier; GAIE's 4 characters a token for a prompt keyed by its
// bytes). It never fails the request: kvix failing open is every endpoint matching 0.
func (s *Scorer) PrepareRequestData(ctx context.Context, req *fwksched.LLMRequest, endpoints []fwksched.Endpoint) error {
	p, names := s.prepare(ctx, req, endpoints)
	unit := int(s.blockTokens())
	if !p.tokens {
		unit = int(wire.ByteChunk) / 4
	}
	for i, e := range endpoints {
		e.Put(attrprefix.PrefixCacheMatchInfoKey, attrprefix.NewPrefixCacheMatchInfo(int(p.reuse[names[i]]), p.blocks, unit))
	}
	return nil
}

// prepare queries kvix for req and keeps the answer for Score, PreRequest and the
// response; names are the endpoints' worker names.
func (s *Scorer) prepare(ctx context.Context, req *fwksched.LLMRequest, endpoints []fwksched.Endpoint) (*scored, []string) {
	names := make([]string, len(endpoints))
	for i, e := range endpoints {
		names[i] = s.WorkerName(metaOf(e))
	}
	s.announce(ctx, names)
	p := &scored{reuse: map[string]float64{}, at: time.Now()}
	if ks, chain, ok := s.prompt(ctx, req); ok && len(chain) > 0 {
		p.ks, p.chain, p.blocks, p.tokens = ks, chain, len(chain), ks.Kind == wire.ChunkTokens
		o := s.client.QueryChain(ctx, ks, chain, kvix.QueryOptions{Candidates: names})
		if o.Reason == kvix.ReasonScores || o.Reason == kvix.ReasonEmpty {
			p.predicted = map[string]float64{}
		}
		for _, sc := range o.Scores {
			p.predicted[sc.Name] = float64(sc.Blocks)
			p.reuse[sc.Name] = min(sc.ExpectedReuse(), float64(len(chain)))
		}
	}
	s.remember(req.RequestId, p)
	return p, names
}

// Score is each endpoint's reusable prefix as a share of the prompt, weighed by tier:
// 0 for every endpoint when kvix does not answer in time (fail open). It reads the
// answer PrepareRequestData got, or asks kvix itself when that did not run.
func (s *Scorer) Score(ctx context.Context, _ *fwksched.CycleState, req *fwksched.LLMRequest, endpoints []fwksched.Endpoint) map[fwksched.Endpoint]float64 {
	p := s.lookup(req.RequestId)
	if p == nil {
		p, _ = s.prepare(ctx, req, endpoints)
	}
	out := make(map[fwksched.Endpoint]float64, len(endpoints))
	for _, e := range endpoints {
		out[e] = 0
		if p.blocks > 0 {
			out[e] = p.reuse[s.WorkerName(metaOf(e))] / float64(p.blocks)
		}
	}
	return out
}

// PreRequest tells kvix where the request went: a worker fed by placements now holds
// the prompt's blocks.
func (s *Scorer) PreRequest(_ context.Context, req *fwksched.LLMRequest, res *fwksched.SchedulingResult) {
	p := s.lookup(req.RequestId)
	if p == nil || len(p.chain) == 0 || res == nil {
		return
	}
	r := res.ProfileResults[res.PrimaryProfileName]
	if r == nil || len(r.TargetEndpoints) == 0 {
		return
	}
	worker := s.WorkerName(metaOf(r.TargetEndpoints[0]))
	s.client.PublishPlacement(worker, p.ks, p.chain)
	// Placed: what the response's report needs is small; the chain (8 bytes a block) goes.
	s.mu.Lock()
	p.worker, p.chain = worker, nil
	s.mu.Unlock()
}

// ResponseBody reports to kvix, once the response ended, the reuse the engine says it
// had (usage.prompt_tokens_details.cached_tokens, read by the kvix-openai-parser)
// against the reuse kvix predicted for the worker. Only requests scored by their token
// ids are reported: a byte-keyspace prediction is not in the engine's tokens.
func (s *Scorer) ResponseBody(_ context.Context, req *fwksched.LLMRequest, resp *fwkrc.Response, _ *fwkdl.EndpointMetadata) {
	if resp == nil || !resp.EndOfStream {
		return
	}
	p := s.take(req.RequestId)
	if p == nil || !p.tokens || p.worker == "" || p.predicted == nil {
		return
	}
	sample := kvix.ReuseSample{Worker: p.worker, Model: p.ks.Model, PromptTokens: uint32(resp.Usage.PromptTokens)}
	if blocks, ok := p.predicted[p.worker]; ok {
		tokens := uint32(blocks) * s.blockTokens()
		sample.PredictedTokens = &tokens
	}
	if d := resp.Usage.PromptTokenDetails; d != nil {
		cached := uint32(d.CachedTokens)
		sample.CachedTokens = &cached
	}
	s.client.ReportReuse(sample) // no figure: counted by the client as unreported
}

// announce registers endpoints not seen before as placement-fed workers, when asked to.
func (s *Scorer) announce(ctx context.Context, names []string) {
	if s.params.Announce == nil {
		return
	}
	feed := wire.Feed{Kind: wire.FeedPlacements, CapacityBlocks: s.params.Announce.CapacityBlocks,
		TTLMs: s.params.Announce.TTLMs}
	for _, n := range names {
		s.mu.Lock()
		done := s.announced[n]
		s.announced[n] = true
		s.mu.Unlock()
		if done {
			continue
		}
		// Owned from now on: announced again on every reconnect, even if this one fails.
		_, _ = s.client.Announce(ctx, n, []wire.Lane{wire.FullLane(s.blockTokens())}, feed)
	}
}

func (s *Scorer) blockTokens() uint32 {
	if s.params.TokenBlock != 0 {
		return s.params.TokenBlock
	}
	return 16
}

// kept is how long a scored request is kept for its PreRequest and its response's end:
// past it (a request never sent, a response never seen) it is swept, once a second.
const kept = time.Minute

func (s *Scorer) remember(id string, p *scored) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now := time.Now(); now.Sub(s.swept) > time.Second {
		s.swept = now
		for k, v := range s.requests {
			if now.Sub(v.at) > kept {
				delete(s.requests, k)
			}
		}
	}
	s.requests[id] = p
}

func (s *Scorer) lookup(id string) *scored {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests[id]
}

func (s *Scorer) take(id string) *scored {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.requests[id]
	delete(s.requests, id)
	return p
}
