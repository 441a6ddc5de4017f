package kvix

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvix/kvix/client/go/wire"
)

func TestAnAnswerBecomesNamedScoresWithTiersHistoryAndSuspects(t *testing.T) {
	c := &Client{}
	s := &server{relist: make(chan struct{}, 1)}
	s.roster.init()
	s.roster.learn("a", 1)
	lagging := wire.SuspectEventsLagging
	o := c.outcome(s, &wire.TieredAnswer{Scores: []wire.TieredScore{
		{Worker: 2, Tiers: wire.Depths{GPU: 7, CPU: 7, Storage: 7}, Suspect: &lagging},
		{Worker: 1, Tiers: wire.Depths{GPU: 0, CPU: 8, Storage: 8}},
	}, HistoryLost: []uint32{1}}, wire.WeightsDynamo)
	if o.Reason != ReasonScores || len(o.Scores) != 2 {
		t.Fatalf("%s", describe(o))
	}
	first, second := o.Scores[0], o.Scores[1]
	if first.Name != "" || first.Blocks != 7 || first.Reuse != 7 || first.ExpectedReuse() != 3.5 || first.HistoryLost {
		t.Fatalf("worker 2: %+v", first)
	}
	if second.Name != "a" || second.Blocks != 8 || second.Reuse != 6 || !second.HistoryLost || second.Suspect != nil {
		t.Fatalf("worker 1: %+v", second)
	}
	select {
	case <-s.relist:
	default:
		t.Fatal("an unnamed id did not ask for the roster")
	}
	if o := c.outcome(s, &wire.ErrorReply{Code: wire.CodeBadRequest, Message: "weights"}, wire.WeightsDynamo); o.Reason != ReasonRejected {
		t.Fatalf("%s", describe(o))
	}
	if o := c.outcome(s, &wire.TieredAnswer{}, wire.WeightsDynamo); o.Reason != ReasonEmpty {
		t.Fatalf("%s", describe(o))
	}
}

func TestPickWeighsReuseAgainstLoadAsTheRustClientDoes(t *testing.T) {
	scores := Outcome{Reason: ReasonScores, Scores: []WorkerScore{{Name: "b", Reuse: 10}}}
	for _, tc := range []struct {
		name  string
		o     Outcome
		eps   []Endpoint
		alpha float64
		want  int
	}{
		{"reuse beats a small load", scores, []Endpoint{{"a", 0}, {"b", 3}, {"c", 0}}, 1, 1},
		{"a large load beats reuse", scores, []Endpoint{{"a", 0}, {"b", 11}}, 1, 0},
		{"load breaks a tie", Outcome{}, []Endpoint{{"a", 2}, {"b", 1}}, 1, 1},
		{"alpha 0 ignores load", scores, []Endpoint{{"a", 0}, {"b", 100}}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, ok := Pick(tc.o, tc.eps, tc.alpha, 7)
			if !ok || p.Index != tc.want {
				t.Fatalf("picked %+v", p)
			}
		})
	}
	if _, ok := Pick(scores, nil, 1, 0); ok {
		t.Fatal("picked among no endpoints")
	}
	// Equal endpoints share the work across requests.
	seen := map[int]bool{}
	for tie := uint64(0); tie < 64; tie++ {
		p, _ := Pick(Outcome{}, []Endpoint{{"a", 0}, {"b", 0}, {"c", 0}}, 1, tie)
		seen[p.Index] = true
	}
	if len(seen) != 3 {
		t.Fatalf("ties went to %v", seen)
	}
}

func TestConfigValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Servers = nil }, "Servers"},
		{func(c *Config) { c.TokenBlock = 0 }, "TokenBlock"},
		{func(c *Config) { c.Deadline = 0 }, "Deadline"},
		{func(c *Config) { c.Queue = 0 }, "Queue"},
		{func(c *Config) { c.Weights.CPU = 2 }, "Weights"},
		{func(c *Config) { c.Servers = []string{"unix:"} }, "Servers"},
	} {
		cfg := DefaultConfig()
		tc.edit(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrConfig) {
			t.Errorf("%s: got %v", tc.want, err)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestARosterListedUnderAnotherReissuedCountIsListedAgainFromZero(t *testing.T) {
	var r roster
	r.init()
	if r.page(&wire.Roster{Workers: []wire.RosterEntry{{Worker: 0, Name: "a"}, {Worker: 1, Name: "b"}}, Next: 2, More: true}, true) {
		t.Fatal("a first page asked for a relist")
	}
	if id, _ := r.id("b"); id != 1 || r.stale(0) {
		t.Fatalf("b is %d", id)
	}
	// Id 1 was given to another name since: a later page under a new count starts over.
	if !r.page(&wire.Roster{Workers: []wire.RosterEntry{{Worker: 2, Name: "c"}}, Next: 3, Reissued: 1}, false) {
		t.Fatal("a page under another reissued count did not ask for a relist")
	}
	if _, ok := r.id("b"); ok {
		t.Fatal("names learnt under the old count survived")
	}
	if r.page(&wire.Roster{Workers: []wire.RosterEntry{{Worker: 0, Name: "a"}, {Worker: 1, Name: "d"}}, Next: 2, Reissued: 1}, true) {
		t.Fatal("the relist asked for another")
	}
	if n, _ := r.name(1); n != "d" || !r.stale(0) || r.stale(1) {
		t.Fatalf("id 1 is %q", n)
	}
	// A name that moves to another id drops its old id's name.
	r.learn("a", 5)
	if _, ok := r.name(0); ok {
		t.Fatal("id 0 still names a")
	}
}
