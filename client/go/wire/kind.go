package wire

import "fmt"

// Kind is a frame's message kind (docs/protocol.md §4.1).
type Kind uint8

// The message kinds, as the header's kind byte spells them.
const (
	KindHello         Kind = 1
	KindWelcome       Kind = 2
	KindQuery         Kind = 3
	KindAnswer        Kind = 4
	KindAnnounce      Kind = 5
	KindAnnounced     Kind = 6
	KindRetire        Kind = 7
	KindEventBatch    Kind = 8
	KindApplied       Kind = 9
	KindPlacement     Kind = 10
	KindStatsRequest  Kind = 11
	KindStats         Kind = 12
	KindEcho          Kind = 13
	KindAck           Kind = 14
	KindErrorReply    Kind = 15
	KindRosterRequest Kind = 16
	KindRoster        Kind = 17
	KindTieredQuery   Kind = 18
	KindTieredAnswer  Kind = 19
	KindReuseReport   Kind = 20
)

var kindNames = [...]string{"", "Hello", "Welcome", "Query", "Answer", "Announce", "Announced",
	"Retire", "EventBatch", "Applied", "Placement", "StatsRequest", "Stats", "Echo", "Ack",
	"ErrorReply", "RosterRequest", "Roster", "TieredQuery", "TieredAnswer", "ReuseReport"}

// Since is the protocol version the kind exists from; ok is false for an unknown kind.
func (k Kind) Since() (version uint16, ok bool) {
	switch {
	case k >= KindHello && k <= KindRoster:
		return 4, true
	case k >= KindTieredQuery && k <= KindReuseReport:
		return 5, true
	}
	return 0, false
}

func (k Kind) String() string {
	if int(k) < len(kindNames) && k != 0 {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// ErrorCode is what an ErrorReply tells a client to do (docs/protocol.md §4.3).
type ErrorCode uint8

// The error codes, by tag.
const (
	CodeBadFrame ErrorCode = iota
	CodeUnsupportedVersion
	CodeNoHello
	CodeUnauthorized
	CodeBlockSizeMismatch
	CodeUnknownWorker
	CodeBadLane
	CodeLanesInByteKeyspace
	CodeOverloaded
	CodeInternal
	CodeBadSource
	CodeTooManySources
	CodeTooLarge
	CodeBadSequence
	CodeLogUnavailable
	CodeBadRequest
	CodeStale
	numErrorCodes
)

var codeNames = [...]string{"BadFrame", "UnsupportedVersion", "NoHello", "Unauthorized",
	"BlockSizeMismatch", "UnknownWorker", "BadLane", "LanesInByteKeyspace", "Overloaded",
	"Internal", "BadSource", "TooManySources", "TooLarge", "BadSequence", "LogUnavailable",
	"BadRequest", "Stale"}

func (c ErrorCode) String() string {
	if c < numErrorCodes {
		return codeNames[c]
	}
	return fmt.Sprintf("ErrorCode(%d)", uint8(c))
}

// Tier is where a worker holds a block: GPU, then CPU memory, then storage.
type Tier uint8

// The tiers, in the order an engine loads a prefix from.
const (
	TierGPU Tier = iota
	TierCPU
	TierStorage
)

// SuspectCause is why the server doubts a worker's score (docs/operations.md, Reuse verdicts).
type SuspectCause uint8

// The causes, by tag.
const (
	SuspectGatewayTokenization SuspectCause = iota
	SuspectEventsMissing
	SuspectEventsLagging
	SuspectUndercounted
)

var suspectNames = [...]string{"gateway_tokenization", "events_missing", "events_lagging", "undercounted"}

func (c SuspectCause) String() string {
	if int(c) < len(suspectNames) {
		return suspectNames[c]
	}
	return fmt.Sprintf("SuspectCause(%d)", uint8(c))
}
