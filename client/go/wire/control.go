package wire

// The messages that neither query nor change the index.

// StatsRequest asks for the server's Stats.
type StatsRequest struct{}

func (*StatsRequest) Kind() Kind      { return KindStatsRequest }
func (*StatsRequest) encode(*encoder) {}

// Ack is success with nothing else to say.
type Ack struct{}

func (*Ack) Kind() Kind      { return KindAck }
func (*Ack) encode(*encoder) {}

// Stats is the reply to StatsRequest.
type Stats struct {
	Workers                              uint32
	Blocks, Memberships, Queries, Events uint64
	ShardLoad                            []uint64 // queries answered, per executor
}

func (*Stats) Kind() Kind { return KindStats }
func (m *Stats) encode(e *encoder) {
	load := e.u64sData(m.ShardLoad)
	at := e.reserve(48, 8)
	e.u32(at, m.Workers)
	e.u64(at+8, m.Blocks)
	e.u64(at+16, m.Memberships)
	e.u64(at+24, m.Queries)
	e.u64(at+32, m.Events)
	e.vec(at+40, load, len(m.ShardLoad))
}
func decodeStats(d *decoder) *Stats {
	at := d.root(48)
	if at < 0 {
		return nil
	}
	return &Stats{Workers: d.u32(at), Blocks: d.u64(at + 8), Memberships: d.u64(at + 16),
		Queries: d.u64(at + 24), Events: d.u64(at + 32), ShardLoad: d.u64s(at + 40)}
}

// Echo asks the server for ReplyLen zero bytes back: the transport's latency floor.
type Echo struct {
	Payload  []byte
	ReplyLen uint32
}

func (*Echo) Kind() Kind { return KindEcho }
func (m *Echo) encode(e *encoder) {
	payload := e.bytesData(m.Payload)
	at := e.reserve(12, 4)
	e.vec(at, payload, len(m.Payload))
	e.u32(at+8, m.ReplyLen)
}
func decodeEcho(d *decoder) *Echo {
	at := d.root(12)
	if at < 0 {
		return nil
	}
	return &Echo{Payload: d.bytes(at), ReplyLen: d.u32(at + 8)}
}

// ErrorReply is the reply to a request that failed.
type ErrorReply struct {
	Code    ErrorCode
	Message string
}

func (*ErrorReply) Kind() Kind { return KindErrorReply }
func (m *ErrorReply) encode(e *encoder) {
	msg := e.strData(m.Message)
	at := e.reserve(12, 4)
	e.u8(at, uint8(m.Code))
	e.str(at+4, m.Message, msg)
}
func decodeErrorReply(d *decoder) *ErrorReply {
	at := d.root(12)
	if at < 0 {
		return nil
	}
	return &ErrorReply{Code: ErrorCode(d.tag(at, uint8(numErrorCodes), "ErrorCode")),
		Message: d.str(at + 4)}
}

// RosterRequest asks for the names of workers any client announced.
type RosterRequest struct {
	From  uint32   // every active worker with an id from From on
	Names []string // and these, whatever their id
}

func (*RosterRequest) Kind() Kind { return KindRosterRequest }
func (m *RosterRequest) encode(e *encoder) {
	data := make([]int, len(m.Names))
	for i, n := range m.Names {
		data[i] = e.strData(n)
	}
	e.align(4)
	names := len(e.b)
	for i, n := range m.Names {
		e.str(e.reserve(8, 4), n, data[i])
	}
	at := e.reserve(12, 4)
	e.u32(at, m.From)
	e.vec(at+4, names, len(m.Names))
}
func decodeRosterRequest(d *decoder) *RosterRequest {
	at := d.root(12)
	if at < 0 {
		return nil
	}
	m := &RosterRequest{From: d.u32(at)}
	if s, n := d.vec(at+4, 8, 4); n > 0 && d.err == nil {
		m.Names = make([]string, n)
		for i := range m.Names {
			m.Names[i] = d.str(s + 8*i)
		}
	}
	return m
}

// RosterEntry is one worker's id and name.
type RosterEntry struct {
	Worker uint32
	Name   string
}

// Roster is the reply to RosterRequest.
type Roster struct {
	Workers  []RosterEntry
	Next     uint32 // where the id-ordered listing stopped
	More     bool   // ask again from Next
	Reissued uint32 // ids given to another name since the server started
}

func (*Roster) Kind() Kind { return KindRoster }
func (m *Roster) encode(e *encoder) {
	data := make([]int, len(m.Workers))
	for i, w := range m.Workers {
		data[i] = e.strData(w.Name)
	}
	e.align(4)
	workers := len(e.b)
	for i, w := range m.Workers {
		at := e.reserve(12, 4)
		e.u32(at, w.Worker)
		e.str(at+4, w.Name, data[i])
	}
	at := e.reserve(20, 4)
	e.vec(at, workers, len(m.Workers))
	e.u32(at+8, m.Next)
	e.boolean(at+12, m.More)
	e.u32(at+16, m.Reissued)
}
func decodeRoster(d *decoder) *Roster {
	at := d.root(20)
	if at < 0 {
		return nil
	}
	m := &Roster{Next: d.u32(at + 8), More: d.boolean(at + 12), Reissued: d.u32(at + 16)}
	if s, n := d.vec(at, 12, 4); n > 0 && d.err == nil {
		m.Workers = make([]RosterEntry, n)
		for i := range m.Workers {
			m.Workers[i] = RosterEntry{Worker: d.u32(s + 12*i), Name: d.str(s + 12*i + 4)}
		}
	}
	return m
}
