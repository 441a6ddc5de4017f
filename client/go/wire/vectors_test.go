package wire

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// The vectors kvix-wire writes (wire/tests/vectors.rs); each frame's message is built
// here as it is there.
const vectorsPath = "../../../wire/tests/golden/frames_v5.txt"

func sized(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(i%26)
	}
	return string(b)
}

func ptr[T any](v T) *T { return &v }

func ksFull() Keyspace {
	return Keyspace{Model: "meta-llama/Llama-3.1-8B", Lora: "sql", Salt: "tenant-42-salt", Kind: ChunkBytes}
}

func queryFull() Query {
	return Query{Keyspace: ksFull(), Chain: []uint64{1, ^uint64(0), 0x0123_4567_89ab_cdef},
		Candidates: []uint32{7, 9}, TopK: 3, WantRuns: true}
}

func testRuns() []WorkerRuns {
	return []WorkerRuns{
		{Worker: 1, Lanes: []LaneRuns{
			{Lane: 0, Runs: []Run{{0, 8}, {9, 12}}},
			{Lane: 1},
		}},
		{Worker: 2},
	}
}

var codeNamesInOrder = codeNames

// vectorMessages is every frame vector's message by name.
func vectorMessages() map[string]Message {
	m := map[string]Message{
		"hello":        &Hello{Client: "gw-1", TokenBlock: 16},
		"hello-v4":     &Hello{Client: "gw-1", TokenBlock: 16},
		"hello-auth":   &Hello{Client: "gateway-replica-0042", TokenBlock: 16, Auth: ptr("s3cr3t-token-0123456789")},
		"welcome":      &Welcome{Server: "kvix-server 0.1.0", TokenBlock: 16, ByteChunk: 256, Shards: 2, MaxFrame: 4 << 20},
		"query-empty":  &Query{Keyspace: TokensKeyspace("m")},
		"query-full":   ptr(queryFull()),
		"query-v4":     ptr(queryFull()),
		"tiered-query": &TieredQuery{Query: queryFull(), Weights: WeightsDynamo},
		"answer-empty": &Answer{},
		"answer-full": &Answer{Scores: []Score{{1, 8}, {2, 7}}, Unscorable: 1, Runs: testRuns(),
			HistoryLost: []uint32{2}, Reissued: 3},
		"tiered-answer": &TieredAnswer{Scores: []TieredScore{
			{Worker: 2, Tiers: Depths{7, 7, 7}, Suspect: ptr(SuspectEventsLagging)},
			{Worker: 1, Tiers: Depths{0, 8, 8}},
		}, Unscorable: 2, Runs: testRuns(), HistoryLost: []uint32{1, 2}, Stale: true},
		"announce-placements": &Announce{Name: "w-0", Lanes: []Lane{FullLane(16)},
			Feed: Feed{Kind: FeedPlacements, CapacityBlocks: 1000, TTLMs: 60_000}},
		"announce-events": &Announce{Name: "engine-a/dp1-with-a-long-name", Lanes: []Lane{
			FullLane(16),
			{Kind: LaneSlidingWindow, Param: 4096, BlockTokens: 32},
			{Kind: LaneChunkedLocal, Param: 8192, BlockTokens: 16},
			{Kind: LaneMlaAttention, BlockTokens: 16},
			{Kind: LaneMamba, BlockTokens: 64},
		}, Source: &EventSource{Endpoint: "tcp://10.0.0.7:5557", Replay: "tcp://10.0.0.7:5558",
			Model: "meta-llama/Llama-3.1-8B"}},
		"announced": &Announced{Worker: 7, Created: true},
		"retire":    &Retire{Worker: 7},
		"event-batch": &EventBatch{Worker: 3, Seq: 42, Keyspace: TokensKeyspace("m"), Events: []Event{
			{Kind: EventStored, Chain: []uint64{1, 2}, Engine: []uint64{11}},
			{Kind: EventStored, Lane: 1, Start: 2, Parent: ptr(uint64(99)), Chain: []uint64{3}},
			{Kind: EventRemoved, Hashes: []uint64{11}},
			{Kind: EventCleared},
			{Kind: EventStoredIn, Tier: TierCPU, Chain: []uint64{5}, Engine: []uint64{55}},
			{Kind: EventRemovedFrom, Tier: TierStorage, Lane: 1, Hashes: []uint64{55, 56}},
		}},
		"applied":           &Applied{Seq: 42, Status: ApplyApplied},
		"applied-duplicate": &Applied{Seq: 42, Status: ApplyDuplicate},
		"applied-gap":       &Applied{Seq: 42, Status: ApplyGap, Expected: 40},
		"placement-no-reply": &Placement{Worker: 3, Keyspace: TokensKeyspace("meta-llama/Llama-3.1-8B"),
			Chain: []uint64{7, 8, 9}},
		"stats-request": &StatsRequest{},
		"stats": &Stats{Workers: 2, Blocks: 1 << 40, Memberships: 3, Queries: 4, Events: 5,
			ShardLoad: []uint64{10, 20}},
		"echo":           &Echo{Payload: []byte{1, 2, 3}, ReplyLen: 64},
		"ack":            &Ack{},
		"ack-v4":         &Ack{},
		"roster-request": &RosterRequest{From: 5, Names: []string{"a", "a-longer-name"}},
		"roster": &Roster{Workers: []RosterEntry{{0, "w-0"}, {1, "worker-number-one"}}, Next: 2,
			More: true, Reissued: 1},
		"reuse-report": &ReuseReport{Reports: []Reuse{
			{Worker: 1, Model: "m", PredictedTokens: ptr(uint32(64)), CachedTokens: 48, PromptTokens: 100},
			{Worker: 2, Model: "meta-llama/Llama-3.1-8B", PromptTokens: 17},
		}},
	}
	for _, n := range []int{0, 8, 9, 63, 64, 300} {
		m[fmt.Sprintf("hello-client-%d", n)] = &Hello{Client: sized(n), TokenBlock: 16}
	}
	for i, name := range codeNamesInOrder {
		m["error-"+name] = &ErrorReply{Code: ErrorCode(i), Message: "refused: " + name}
	}
	docQuery := Query{Keyspace: TokensKeyspace("meta-llama/Llama-3.1-8B"),
		Chain: []uint64{0x884d_938a_f32e_36f4, 0x56ef_dfc1_cc32_333e}, Candidates: []uint32{7}, TopK: 4}
	m["doc-hello"] = &Hello{Client: "gw-1", TokenBlock: 16, Auth: ptr("s3cr3t")}
	m["doc-query"] = &docQuery
	m["doc-retire"] = &Retire{Worker: 7}
	m["doc-ack"] = &Ack{}
	m["doc-tiered-query"] = &TieredQuery{Query: docQuery, Weights: WeightsDynamo}
	m["doc-tiered-answer"] = &TieredAnswer{Scores: []TieredScore{{Worker: 7, Tiers: Depths{1, 2, 2}}}}
	m["doc-ack-v4"] = &Ack{}
	return m
}

type frameVector struct {
	name    string
	version uint16
	id      uint64
	flags   uint8
	bytes   []byte
}

type checkVector struct {
	name, expect string
	max          uint32
	bytes        []byte
}

func readVectors(t testing.TB) ([]frameVector, []checkVector) {
	t.Helper()
	f, err := os.Open(vectorsPath)
	if err != nil {
		t.Fatalf("the shared vectors (cargo test -p kvix-wire --test vectors writes them): %v", err)
	}
	defer f.Close()
	var frames []frameVector
	var checks []checkVector
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		b, err := hex.DecodeString(fields[len(fields)-1])
		if err != nil {
			t.Fatalf("%s: %v", fields[1], err)
		}
		num := func(s string) uint64 {
			v, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				t.Fatalf("%s: %v", fields[1], err)
			}
			return v
		}
		switch fields[0] {
		case "frame":
			frames = append(frames, frameVector{fields[1], uint16(num(fields[2])), num(fields[3]), uint8(num(fields[4])), b})
		case "check":
			checks = append(checks, checkVector{fields[1], fields[3], uint32(num(fields[2])), b})
		default:
			t.Fatalf("unknown line %q", fields[0])
		}
	}
	if len(frames) == 0 || len(checks) == 0 {
		t.Fatalf("%s holds %d frames and %d checks", vectorsPath, len(frames), len(checks))
	}
	return frames, checks
}

func TestEveryVectorEncodesToItsBytesAndReadsBack(t *testing.T) {
	frames, _ := readVectors(t)
	msgs := vectorMessages()
	kinds := map[Kind]bool{}
	for _, v := range frames {
		t.Run(v.name, func(t *testing.T) {
			m, ok := msgs[v.name]
			if !ok {
				t.Fatalf("no Go message for vector %q: add it to vectorMessages", v.name)
			}
			delete(msgs, v.name)
			kinds[m.Kind()] = true
			got, err := AppendVersion(nil, m, v.version, v.id, v.flags)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, v.bytes) {
				t.Fatalf("encoding differs:\n go   %x\n rust %x", got, v.bytes)
			}
			f, ok, err := SplitFrame(v.bytes, DefaultMaxFrame)
			if err != nil || !ok || f.Len != len(v.bytes) {
				t.Fatalf("split: ok %v err %v", ok, err)
			}
			if f.Header.RequestID != v.id || f.Header.Flags != v.flags || f.Header.Version != v.version {
				t.Fatalf("header %+v", f.Header)
			}
			back, err := f.Message()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, m) {
				t.Fatalf("read back %+v, want %+v", back, m)
			}
		})
	}
	for name := range msgs {
		t.Errorf("Go message %q has no vector", name)
	}
	for k := KindHello; k <= KindReuseReport; k++ {
		if !kinds[k] {
			t.Errorf("no vector of kind %v", k)
		}
	}
}

var frameErrors = map[string]error{
	"BadMagic": ErrBadMagic, "UnsupportedVersion": ErrUnsupportedVersion, "Reserved": ErrReserved,
	"UnknownKind": ErrUnknownKind, "KindTooNew": ErrKindTooNew, "UnknownFlags": ErrUnknownFlags,
	"Oversize": ErrOversize, "InvalidBody": ErrInvalidBody,
}

func TestEveryCheckGetsTheErrorKvixWireGives(t *testing.T) {
	_, checks := readVectors(t)
	for _, c := range checks {
		t.Run(c.name, func(t *testing.T) {
			n, err := ValidateStream(c.bytes, c.max)
			if want, ok := strings.CutPrefix(c.expect, "ok:"); ok {
				if err != nil || strconv.Itoa(n) != want {
					t.Fatalf("got %d frames, %v; want %s frames", n, err, want)
				}
				return
			}
			want, ok := frameErrors[c.expect]
			if !ok {
				t.Fatalf("unknown expectation %q", c.expect)
			}
			if !errors.Is(err, want) {
				t.Fatalf("got %v, want %s", err, c.expect)
			}
		})
	}
}

// Each hex dump of docs/protocol.md §8 is the vector of the same name.
func TestTheDocumentsDumpsAreTheVectors(t *testing.T) {
	doc, err := os.ReadFile("../../../docs/protocol.md")
	if err != nil {
		t.Fatal(err)
	}
	frames, _ := readVectors(t)
	byName := map[string][]byte{}
	for _, v := range frames {
		byName[v.name] = v.bytes
	}
	dumps := 0
	for _, part := range strings.Split(string(doc), "<!-- hex:")[1:] {
		name, body, _ := strings.Cut(part, " -->")
		body, _, _ = strings.Cut(body, "<!-- /hex -->")
		var got []byte
		for _, line := range strings.Split(body, "\n") {
			line, _, _ = strings.Cut(line, "#")
			_, hexes, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			for _, h := range strings.Fields(hexes) {
				b, err := strconv.ParseUint(h, 16, 8)
				if err != nil {
					t.Fatalf("hex:%s: %q", name, h)
				}
				got = append(got, byte(b))
			}
		}
		want, ok := byName["doc-"+name]
		if !ok {
			t.Fatalf("docs/protocol.md dump %q has no vector doc-%s", name, name)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("hex:%s differs from its vector:\n doc    %x\n vector %x", name, got, want)
		}
		dumps++
	}
	if dumps < 7 {
		t.Fatalf("found %d dumps in docs/protocol.md", dumps)
	}
}
