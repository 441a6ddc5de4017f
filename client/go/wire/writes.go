package wire

// The messages that change the index (Announce, Retire, EventBatch, Placement) and
// their replies.

// LaneTag is a lane kind's tag (docs/protocol.md §6).
type LaneTag uint8

// The lane kinds, by tag.
const (
	LaneFullAttention LaneTag = iota
	LaneMlaAttention
	LaneSlidingWindow // Param: the window in tokens
	LaneChunkedLocal  // Param: the chunk in tokens
	LaneMamba
)

// Lane is one independently evicted cache group of a worker.
type Lane struct {
	Kind        LaneTag
	Param       uint32 // the window or chunk of LaneSlidingWindow and LaneChunkedLocal; else 0
	BlockTokens uint32 // the lane's engine block in tokens
}

// FullLane is the one lane of a plain worker with engine blocks of blockTokens tokens.
func FullLane(blockTokens uint32) Lane {
	return Lane{Kind: LaneFullAttention, BlockTokens: blockTokens}
}

// FeedKind says how the server learns a worker's holdings.
type FeedKind uint8

// Exact engine events, or gateways' placements.
const (
	FeedEvents FeedKind = iota
	FeedPlacements
)

// Feed is how a worker's holdings are learnt.
type Feed struct {
	Kind           FeedKind
	CapacityBlocks uint64 // FeedPlacements: at most this many blocks kept, LRU
	TTLMs          uint64 // FeedPlacements: entries expire after this; 0 = never
}

// EventSource is where the server may subscribe to a worker's engine events.
type EventSource struct{ Endpoint, Replay, Model, Salt string }

// Announce registers or re-registers a worker and its lane roster.
type Announce struct {
	Name   string
	Lanes  []Lane
	Feed   Feed
	Source *EventSource
}

func (*Announce) Kind() Kind { return KindAnnounce }
func (m *Announce) encode(e *encoder) {
	name := e.strData(m.Name)
	e.align(4)
	lanes := len(e.b)
	for _, l := range m.Lanes {
		at := e.reserve(12, 4)
		e.u8(at, uint8(l.Kind))
		e.u32(at+4, l.Param)
		e.u32(at+8, l.BlockTokens)
	}
	var src [4]int
	if s := m.Source; s != nil {
		src = [4]int{e.strData(s.Endpoint), e.strData(s.Replay), e.strData(s.Model), e.strData(s.Salt)}
	}
	at := e.reserve(80, 8)
	e.str(at, m.Name, name)
	e.vec(at+8, lanes, len(m.Lanes))
	e.u8(at+16, uint8(m.Feed.Kind))
	if m.Feed.Kind == FeedPlacements {
		e.u64(at+24, m.Feed.CapacityBlocks)
		e.u64(at+32, m.Feed.TTLMs)
	}
	if s := m.Source; s != nil {
		e.u8(at+40, 1)
		e.str(at+44, s.Endpoint, src[0])
		e.str(at+52, s.Replay, src[1])
		e.str(at+60, s.Model, src[2])
		e.str(at+68, s.Salt, src[3])
	}
}
func decodeAnnounce(d *decoder) *Announce {
	at := d.root(80)
	if at < 0 {
		return nil
	}
	m := &Announce{Name: d.str(at)}
	if s, n := d.vec(at+8, 12, 4); n > 0 && d.err == nil {
		m.Lanes = make([]Lane, n)
		for i := range m.Lanes {
			p := s + 12*i
			m.Lanes[i] = Lane{Kind: LaneTag(d.tag(p, 5, "LaneKind")), BlockTokens: d.u32(p + 8)}
			if k := m.Lanes[i].Kind; k == LaneSlidingWindow || k == LaneChunkedLocal {
				m.Lanes[i].Param = d.u32(p + 4)
			}
		}
	}
	m.Feed.Kind = FeedKind(d.tag(at+16, 2, "Feed"))
	if m.Feed.Kind == FeedPlacements {
		m.Feed.CapacityBlocks, m.Feed.TTLMs = d.u64(at+24), d.u64(at+32)
	}
	if d.tag(at+40, 2, "Option") == 1 {
		m.Source = &EventSource{Endpoint: d.str(at + 44), Replay: d.str(at + 52),
			Model: d.str(at + 60), Salt: d.str(at + 68)}
	}
	return m
}

// Announced is the reply to Announce.
type Announced struct {
	Worker  uint32
	Created bool // false when the name was known with the same roster
}

func (*Announced) Kind() Kind { return KindAnnounced }
func (m *Announced) encode(e *encoder) {
	at := e.reserve(8, 4)
	e.u32(at, m.Worker)
	e.boolean(at+4, m.Created)
}
func decodeAnnounced(d *decoder) *Announced {
	at := d.root(8)
	if at < 0 {
		return nil
	}
	return &Announced{Worker: d.u32(at), Created: d.boolean(at + 4)}
}

// Retire forgets a worker and everything it holds.
type Retire struct{ Worker uint32 }

func (*Retire) Kind() Kind { return KindRetire }
func (m *Retire) encode(e *encoder) {
	e.u32(e.reserve(4, 4), m.Worker)
}
func decodeRetire(d *decoder) *Retire {
	at := d.root(4)
	if at < 0 {
		return nil
	}
	return &Retire{Worker: d.u32(at)}
}

// EventKind is an engine event's tag.
type EventKind uint8

// The events (docs/protocol.md §7); StoredIn and RemovedFrom name a tier (version 5).
const (
	EventStored EventKind = iota
	EventRemoved
	EventCleared
	EventStoredIn
	EventRemovedFrom
)

// Event is one engine cache event. Which fields count depends on Kind: Stored and
// StoredIn use Lane, Start, Parent, Chain and Engine; Removed and RemovedFrom use Lane
// and Hashes; the ...In / ...From kinds also Tier; Cleared none.
type Event struct {
	Kind   EventKind
	Tier   Tier
	Lane   uint8
	Start  uint32
	Parent *uint64
	Chain  []uint64
	Engine []uint64
	Hashes []uint64
}

func (e *encoder) eventData(ev *Event) (a, b int) {
	switch ev.Kind {
	case EventStored, EventStoredIn:
		return e.u64sData(ev.Chain), e.u64sData(ev.Engine)
	case EventRemoved, EventRemovedFrom:
		return e.u64sData(ev.Hashes), 0
	}
	return 0, 0
}

func (e *encoder) event(at int, ev *Event, a, b int) {
	e.u8(at, uint8(ev.Kind))
	lane := at + 1
	if ev.Kind == EventStoredIn || ev.Kind == EventRemovedFrom {
		e.u8(at+1, uint8(ev.Tier))
		lane = at + 2
	}
	switch ev.Kind {
	case EventStored, EventStoredIn:
		e.u8(lane, ev.Lane)
		e.u32(at+4, ev.Start)
		if ev.Parent != nil {
			e.u8(at+8, 1)
			e.u64(at+16, *ev.Parent)
		}
		e.vec(at+24, a, len(ev.Chain))
		e.vec(at+32, b, len(ev.Engine))
	case EventRemoved, EventRemovedFrom:
		e.u8(lane, ev.Lane)
		e.vec(at+4, a, len(ev.Hashes))
	}
}

func (d *decoder) event(at int) Event {
	ev := Event{Kind: EventKind(d.tag(at, 5, "Event"))}
	lane := at + 1
	if ev.Kind == EventStoredIn || ev.Kind == EventRemovedFrom {
		ev.Tier = Tier(d.tag(at+1, 3, "Tier"))
		lane = at + 2
	}
	switch ev.Kind {
	case EventStored, EventStoredIn:
		ev.Lane, ev.Start = d.u8(lane), d.u32(at+4)
		if d.tag(at+8, 2, "Option") == 1 {
			p := d.u64(at + 16)
			ev.Parent = &p
		}
		ev.Chain, ev.Engine = d.u64s(at+24), d.u64s(at+32)
	case EventRemoved, EventRemovedFrom:
		ev.Lane, ev.Hashes = d.u8(lane), d.u64s(at+4)
	}
	return ev
}

// EventBatch is a batch of one worker's engine events, in order.
type EventBatch struct {
	Worker   uint32
	Seq      uint64
	Keyspace Keyspace
	Events   []Event
}

func (*EventBatch) Kind() Kind { return KindEventBatch }
func (m *EventBatch) encode(e *encoder) {
	ks := e.keyspaceData(&m.Keyspace)
	data := make([][2]int, len(m.Events))
	for i := range m.Events {
		a, b := e.eventData(&m.Events[i])
		data[i] = [2]int{a, b}
	}
	e.align(8)
	events := len(e.b)
	for i := range m.Events {
		at := e.reserve(40, 8)
		e.event(at, &m.Events[i], data[i][0], data[i][1])
	}
	at := e.reserve(56, 8)
	e.u32(at, m.Worker)
	e.u64(at+8, m.Seq)
	e.keyspace(at+16, &m.Keyspace, ks)
	e.vec(at+44, events, len(m.Events))
}
func decodeEventBatch(d *decoder) *EventBatch {
	at := d.root(56)
	if at < 0 {
		return nil
	}
	m := &EventBatch{Worker: d.u32(at), Seq: d.u64(at + 8), Keyspace: d.keyspace(at + 16)}
	if s, n := d.vec(at+44, 40, 8); n > 0 && d.err == nil {
		m.Events = make([]Event, n)
		for i := range m.Events {
			m.Events[i] = d.event(s + 40*i)
		}
	}
	return m
}

// ApplyKind is how a batch was taken.
type ApplyKind uint8

// Applied, ignored as a duplicate, or applied after a gap.
const (
	ApplyApplied ApplyKind = iota
	ApplyDuplicate
	ApplyGap
)

// Applied is the reply to an EventBatch.
type Applied struct {
	Seq      uint64
	Status   ApplyKind
	Expected uint64 // ApplyGap: the first batch that never arrived
}

func (*Applied) Kind() Kind { return KindApplied }
func (m *Applied) encode(e *encoder) {
	at := e.reserve(24, 8)
	e.u64(at, m.Seq)
	e.u8(at+8, uint8(m.Status))
	if m.Status == ApplyGap {
		e.u64(at+16, m.Expected)
	}
}
func decodeApplied(d *decoder) *Applied {
	at := d.root(24)
	if at < 0 {
		return nil
	}
	m := &Applied{Seq: d.u64(at), Status: ApplyKind(d.tag(at+8, 3, "ApplyStatus"))}
	if m.Status == ApplyGap {
		m.Expected = d.u64(at + 16)
	}
	return m
}

// Placement says a gateway dispatched a prompt with this chain to worker.
type Placement struct {
	Worker   uint32
	Keyspace Keyspace
	Chain    []uint64
}

func (*Placement) Kind() Kind { return KindPlacement }
func (m *Placement) encode(e *encoder) {
	ks := e.keyspaceData(&m.Keyspace)
	chain := e.u64sData(m.Chain)
	at := e.reserve(40, 4)
	e.u32(at, m.Worker)
	e.keyspace(at+4, &m.Keyspace, ks)
	e.vec(at+32, chain, len(m.Chain))
}
func decodePlacement(d *decoder) *Placement {
	at := d.root(40)
	if at < 0 {
		return nil
	}
	return &Placement{Worker: d.u32(at), Keyspace: d.keyspace(at + 4), Chain: d.u64s(at + 32)}
}
