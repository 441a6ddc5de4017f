package wire

import "fmt"

// Message is one message body; *T of every type below implements it.
type Message interface {
	Kind() Kind
	encode(e *encoder)
}

// Decode validates body as a message of kind and copies it out.
func Decode(kind Kind, body []byte) (Message, error) {
	d := decoder{b: body}
	var m Message
	switch kind {
	case KindHello:
		m = decodeHello(&d)
	case KindWelcome:
		m = decodeWelcome(&d)
	case KindQuery:
		m = decodeQuery(&d)
	case KindAnswer:
		m = decodeAnswer(&d)
	case KindAnnounce:
		m = decodeAnnounce(&d)
	case KindAnnounced:
		m = decodeAnnounced(&d)
	case KindRetire:
		m = decodeRetire(&d)
	case KindEventBatch:
		m = decodeEventBatch(&d)
	case KindApplied:
		m = decodeApplied(&d)
	case KindPlacement:
		m = decodePlacement(&d)
	case KindStatsRequest:
		m = &StatsRequest{}
	case KindStats:
		m = decodeStats(&d)
	case KindEcho:
		m = decodeEcho(&d)
	case KindAck:
		m = &Ack{}
	case KindErrorReply:
		m = decodeErrorReply(&d)
	case KindRosterRequest:
		m = decodeRosterRequest(&d)
	case KindRoster:
		m = decodeRoster(&d)
	case KindTieredQuery:
		m = decodeTieredQuery(&d)
	case KindTieredAnswer:
		m = decodeTieredAnswer(&d)
	case KindReuseReport:
		m = decodeReuseReport(&d)
	default:
		return nil, fmt.Errorf("%w: %d", ErrUnknownKind, uint8(kind))
	}
	if d.err != nil {
		return nil, fmt.Errorf("%v body: %w", kind, d.err)
	}
	return m, nil
}

// ChunkKind says what a keyspace's blocks are cut from.
type ChunkKind uint8

// Token ids (token_block per block) or raw bytes (ByteChunk per block).
const (
	ChunkTokens ChunkKind = 0
	ChunkBytes  ChunkKind = 1
)

// Keyspace names the space a chain lives in (docs/protocol.md §5.1).
type Keyspace struct {
	Model, Lora, Salt string
	Kind              ChunkKind
}

// TokensKeyspace is the token keyspace of model, without LoRA or salt.
func TokensKeyspace(model string) Keyspace { return Keyspace{Model: model} }

type keyspaceData struct{ model, lora, salt int }

func (e *encoder) keyspaceData(k *Keyspace) keyspaceData {
	return keyspaceData{e.strData(k.Model), e.strData(k.Lora), e.strData(k.Salt)}
}

func (e *encoder) keyspace(at int, k *Keyspace, d keyspaceData) {
	e.str(at, k.Model, d.model)
	e.str(at+8, k.Lora, d.lora)
	e.str(at+16, k.Salt, d.salt)
	e.u8(at+24, uint8(k.Kind))
}

func (d *decoder) keyspace(at int) Keyspace {
	return Keyspace{Model: d.str(at), Lora: d.str(at + 8), Salt: d.str(at + 16),
		Kind: ChunkKind(d.tag(at+24, 2, "ChunkKind"))}
}

// Hello is the client's first frame.
type Hello struct {
	Client     string
	TokenBlock uint32
	Auth       *string // the shared token, when the server requires one
}

func (*Hello) Kind() Kind { return KindHello }
func (m *Hello) encode(e *encoder) {
	client, auth := e.strData(m.Client), -1
	if m.Auth != nil {
		auth = e.strData(*m.Auth)
	}
	at := e.reserve(24, 4)
	e.str(at, m.Client, client)
	e.u32(at+8, m.TokenBlock)
	if m.Auth != nil {
		e.u8(at+12, 1)
		e.str(at+16, *m.Auth, auth)
	}
}
func decodeHello(d *decoder) *Hello {
	at := d.root(24)
	if at < 0 {
		return nil
	}
	m := &Hello{Client: d.str(at), TokenBlock: d.u32(at + 8)}
	if d.tag(at+12, 2, "Option") == 1 {
		s := d.str(at + 16)
		m.Auth = &s
	}
	return m
}

// Welcome is the server's reply to Hello.
type Welcome struct {
	Server                                  string
	TokenBlock, ByteChunk, Shards, MaxFrame uint32
}

func (*Welcome) Kind() Kind { return KindWelcome }
func (m *Welcome) encode(e *encoder) {
	server := e.strData(m.Server)
	at := e.reserve(24, 4)
	e.str(at, m.Server, server)
	e.u32(at+8, m.TokenBlock)
	e.u32(at+12, m.ByteChunk)
	e.u32(at+16, m.Shards)
	e.u32(at+20, m.MaxFrame)
}
func decodeWelcome(d *decoder) *Welcome {
	at := d.root(24)
	if at < 0 {
		return nil
	}
	return &Welcome{Server: d.str(at), TokenBlock: d.u32(at + 8), ByteChunk: d.u32(at + 12),
		Shards: d.u32(at + 16), MaxFrame: d.u32(at + 20)}
}

// Query asks which workers can reuse how much of a chain (every tier counts as GPU).
type Query struct {
	Keyspace   Keyspace
	Chain      []uint64
	Candidates []uint32 // only these worker ids are scored; empty: all
	TopK       uint32   // at most this many scores; 0: all
	WantRuns   bool
}

func (*Query) Kind() Kind          { return KindQuery }
func (m *Query) encode(e *encoder) { encodeQuery(e, m, nil) }

// encodeQuery writes a Query, or a TieredQuery when weights is set.
func encodeQuery(e *encoder, m *Query, weights *TierWeights) {
	ks := e.keyspaceData(&m.Keyspace)
	chain := e.u64sData(m.Chain)
	cands := e.u32sData(m.Candidates)
	size := 52
	if weights != nil {
		size = 60
	}
	at := e.reserve(size, 4)
	e.keyspace(at, &m.Keyspace, ks)
	e.vec(at+28, chain, len(m.Chain))
	e.vec(at+36, cands, len(m.Candidates))
	e.u32(at+44, m.TopK)
	e.boolean(at+48, m.WantRuns)
	if weights != nil {
		e.f32(at+52, weights.CPU)
		e.f32(at+56, weights.Storage)
	}
}
func decodeQueryAt(d *decoder, at int) Query {
	return Query{Keyspace: d.keyspace(at), Chain: d.u64s(at + 28), Candidates: d.u32s(at + 36),
		TopK: d.u32(at + 44), WantRuns: d.boolean(at + 48)}
}
func decodeQuery(d *decoder) *Query {
	at := d.root(52)
	if at < 0 {
		return nil
	}
	q := decodeQueryAt(d, at)
	return &q
}

// TierWeights is what a block reused from CPU memory or storage is worth against one
// from GPU (1); each in [0, 1].
type TierWeights struct{ CPU, Storage float32 }

// Dynamo's KV router's weights (the default) and every tier as good as GPU.
var (
	WeightsDynamo = TierWeights{CPU: 0.75, Storage: 0.25}
	WeightsJoint  = TierWeights{CPU: 1, Storage: 1}
)

// Valid says whether both weights are numbers in [0, 1].
func (w TierWeights) Valid() bool {
	return w.CPU >= 0 && w.CPU <= 1 && w.Storage >= 0 && w.Storage <= 1
}

// TieredQuery is a Query answered by tier (protocol version 5).
type TieredQuery struct {
	Query
	Weights TierWeights
}

func (*TieredQuery) Kind() Kind { return KindTieredQuery }
func (m *TieredQuery) encode(e *encoder) {
	encodeQuery(e, &m.Query, &m.Weights)
}
func decodeTieredQuery(d *decoder) *TieredQuery {
	at := d.root(60)
	if at < 0 {
		return nil
	}
	return &TieredQuery{Query: decodeQueryAt(d, at),
		Weights: TierWeights{CPU: d.f32(at + 52), Storage: d.f32(at + 56)}}
}

// Score is a worker's joint reusable prefix in keyspace blocks.
type Score struct{ Worker, Blocks uint32 }

// Run is a half-open run [Start, End) of block positions a lane holds.
type Run struct{ Start, End uint32 }

// LaneRuns is what one lane of a worker holds along the chain.
type LaneRuns struct {
	Lane uint8
	Runs []Run
}

// WorkerRuns is a worker's runs, one entry per lane of its roster.
type WorkerRuns struct {
	Worker uint32
	Lanes  []LaneRuns
}

// encodeRuns writes a Vec<WorkerRuns>'s data: where its array starts.
func (e *encoder) runsData(v []WorkerRuns) int {
	lanes := make([]int, len(v))
	for i := range v {
		runs := make([]int, len(v[i].Lanes))
		for j, l := range v[i].Lanes {
			e.align(4)
			runs[j] = len(e.b)
			for _, r := range l.Runs {
				at := e.reserve(8, 4)
				e.u32(at, r.Start)
				e.u32(at+4, r.End)
			}
		}
		e.align(4)
		lanes[i] = len(e.b)
		for j, l := range v[i].Lanes {
			at := e.reserve(12, 4)
			e.u8(at, l.Lane)
			e.vec(at+4, runs[j], len(l.Runs))
		}
	}
	e.align(4)
	start := len(e.b)
	for i, w := range v {
		at := e.reserve(12, 4)
		e.u32(at, w.Worker)
		e.vec(at+4, lanes[i], len(w.Lanes))
	}
	return start
}

func (d *decoder) runs(at int) []WorkerRuns {
	start, n := d.vec(at, 12, 4)
	if n == 0 || d.err != nil {
		return nil
	}
	out := make([]WorkerRuns, n)
	for i := range out {
		w := start + 12*i
		out[i].Worker = d.u32(w)
		ls, ln := d.vec(w+4, 12, 4)
		if ln == 0 || d.err != nil {
			continue
		}
		out[i].Lanes = make([]LaneRuns, ln)
		for j := range out[i].Lanes {
			l := ls + 12*j
			out[i].Lanes[j].Lane = d.u8(l)
			rs, rn := d.vec(l+4, 8, 4)
			if rn == 0 || d.err != nil {
				continue
			}
			runs := make([]Run, rn)
			for k := range runs {
				runs[k] = Run{Start: d.u32(rs + 8*k), End: d.u32(rs + 8*k + 4)}
			}
			out[i].Lanes[j].Runs = runs
		}
	}
	return out
}

// Answer is the reply to a Query.
type Answer struct {
	Scores      []Score // best first
	Unscorable  uint32
	Runs        []WorkerRuns // only when asked for
	HistoryLost []uint32     // ids among Scores whose history is lost, ascending
	Reissued    uint32
}

func (*Answer) Kind() Kind { return KindAnswer }
func (m *Answer) encode(e *encoder) {
	e.align(4)
	scores := len(e.b)
	for _, s := range m.Scores {
		at := e.reserve(8, 4)
		e.u32(at, s.Worker)
		e.u32(at+4, s.Blocks)
	}
	runs := e.runsData(m.Runs)
	lost := e.u32sData(m.HistoryLost)
	at := e.reserve(32, 4)
	e.vec(at, scores, len(m.Scores))
	e.u32(at+8, m.Unscorable)
	e.vec(at+12, runs, len(m.Runs))
	e.vec(at+20, lost, len(m.HistoryLost))
	e.u32(at+28, m.Reissued)
}
func decodeAnswer(d *decoder) *Answer {
	at := d.root(32)
	if at < 0 {
		return nil
	}
	m := &Answer{Unscorable: d.u32(at + 8), Runs: d.runs(at + 12), HistoryLost: d.u32s(at + 20),
		Reissued: d.u32(at + 28)}
	if s, n := d.vec(at, 8, 4); n > 0 && d.err == nil {
		m.Scores = make([]Score, n)
		for i := range m.Scores {
			m.Scores[i] = Score{Worker: d.u32(s + 8*i), Blocks: d.u32(s + 8*i + 4)}
		}
	}
	return m
}

// Depths is how deep a worker's reusable prefix reaches loading from GPU only, then
// on from CPU, then from storage (cumulative, in keyspace blocks).
type Depths struct{ GPU, CPU, Storage uint32 }

// Weighed is the depth weighed by tier, as a TieredAnswer ranks.
func (d Depths) Weighed(w TierWeights) float64 {
	cpu := max(d.CPU, d.GPU)
	storage := max(d.Storage, cpu)
	return float64(d.GPU) + float64(w.CPU)*float64(cpu-d.GPU) + float64(w.Storage)*float64(storage-cpu)
}

// TieredScore is a worker's depths, and why the server doubts them if it does.
type TieredScore struct {
	Worker  uint32
	Tiers   Depths
	Suspect *SuspectCause
}

// TieredAnswer is the reply to a TieredQuery.
type TieredAnswer struct {
	Scores      []TieredScore // best first by weighed depth
	Unscorable  uint32
	Runs        []WorkerRuns
	HistoryLost []uint32
	Reissued    uint32
	Stale       bool // the replica knows its copy is behind: ask another
}

func (*TieredAnswer) Kind() Kind { return KindTieredAnswer }
func (m *TieredAnswer) encode(e *encoder) {
	e.align(4)
	scores := len(e.b)
	for _, s := range m.Scores {
		at := e.reserve(20, 4)
		e.u32(at, s.Worker)
		e.u32(at+4, s.Tiers.GPU)
		e.u32(at+8, s.Tiers.CPU)
		e.u32(at+12, s.Tiers.Storage)
		if s.Suspect != nil {
			e.u8(at+16, 1)
			e.u8(at+17, uint8(*s.Suspect))
		}
	}
	runs := e.runsData(m.Runs)
	lost := e.u32sData(m.HistoryLost)
	at := e.reserve(36, 4)
	e.vec(at, scores, len(m.Scores))
	e.u32(at+8, m.Unscorable)
	e.vec(at+12, runs, len(m.Runs))
	e.vec(at+20, lost, len(m.HistoryLost))
	e.u32(at+28, m.Reissued)
	e.boolean(at+32, m.Stale)
}
func decodeTieredAnswer(d *decoder) *TieredAnswer {
	at := d.root(36)
	if at < 0 {
		return nil
	}
	m := &TieredAnswer{Unscorable: d.u32(at + 8), Runs: d.runs(at + 12),
		HistoryLost: d.u32s(at + 20), Reissued: d.u32(at + 28), Stale: d.boolean(at + 32)}
	if s, n := d.vec(at, 20, 4); n > 0 && d.err == nil {
		m.Scores = make([]TieredScore, n)
		for i := range m.Scores {
			p := s + 20*i
			m.Scores[i] = TieredScore{Worker: d.u32(p),
				Tiers: Depths{GPU: d.u32(p + 4), CPU: d.u32(p + 8), Storage: d.u32(p + 12)}}
			if d.tag(p+16, 2, "Option") == 1 {
				c := SuspectCause(d.tag(p+17, 4, "SuspectCause"))
				m.Scores[i].Suspect = &c
			}
		}
	}
	return m
}

// Reuse is what one routed request reused, as its engine reported it.
type Reuse struct {
	Worker          uint32
	Model           string
	PredictedTokens *uint32 // nil: the worker was not in the answer
	CachedTokens    uint32
	PromptTokens    uint32
}

// ReuseReport is a gateway's batch of reuse reports (protocol version 5).
type ReuseReport struct{ Reports []Reuse }

func (*ReuseReport) Kind() Kind { return KindReuseReport }
func (m *ReuseReport) encode(e *encoder) {
	models := make([]int, len(m.Reports))
	for i := range m.Reports {
		models[i] = e.strData(m.Reports[i].Model)
	}
	e.align(4)
	start := len(e.b)
	for i, r := range m.Reports {
		at := e.reserve(28, 4)
		e.u32(at, r.Worker)
		e.str(at+4, r.Model, models[i])
		if r.PredictedTokens != nil {
			e.u8(at+12, 1)
			e.u32(at+16, *r.PredictedTokens)
		}
		e.u32(at+20, r.CachedTokens)
		e.u32(at+24, r.PromptTokens)
	}
	at := e.reserve(8, 4)
	e.vec(at, start, len(m.Reports))
}
func decodeReuseReport(d *decoder) *ReuseReport {
	at := d.root(8)
	if at < 0 {
		return nil
	}
	m := &ReuseReport{}
	s, n := d.vec(at, 28, 4)
	if n == 0 || d.err != nil {
		return m
	}
	m.Reports = make([]Reuse, n)
	for i := range m.Reports {
		p := s + 28*i
		r := Reuse{Worker: d.u32(p), Model: d.str(p + 4), CachedTokens: d.u32(p + 20),
			PromptTokens: d.u32(p + 24)}
		if d.tag(p+12, 2, "Option") == 1 {
			v := d.u32(p + 16)
			r.PredictedTokens = &v
		}
		m.Reports[i] = r
	}
	return m
}
