package kvix

// DefaultAlpha is how many blocks of reuse one unit of load costs by default (Dynamo's
// default overlap weight, load in blocks).
const DefaultAlpha = 1.0

// Endpoint is a worker a gateway may pick, by name, with its load (queued and
// decoding blocks, or requests).
type Endpoint struct {
	Name string
	Load float64
}

// Picked is the chosen endpoint's index and the reuse it was chosen for.
type Picked struct {
	Index int
	Reuse float64
}

// Pick chooses among endpoints for a query's outcome: the highest reuse − alpha·load
// wins (reuse weighed by tier, discounted when suspect); ties go to the less loaded,
// then to a per-request order seeded by tie, so that equal workers share the work. An
// outcome without scores picks by load alone. ok is false only for no endpoints.
// It is the Rust client's pick, to the same choices.
func Pick(o Outcome, endpoints []Endpoint, alpha float64, tie uint64) (p Picked, ok bool) {
	var best key
	for i, e := range endpoints {
		r := 0.0
		for _, s := range o.Scores {
			if s.Name == e.Name {
				r = s.ExpectedReuse()
				break
			}
		}
		k := key{score: r - alpha*e.Load, load: e.Load, order: mix(tie ^ uint64(i)*0x9E37_79B9_7F4A_7C15)}
		if !ok || k.beats(best) {
			best, p, ok = k, Picked{Index: i, Reuse: r}, true
		}
	}
	return p, ok
}

type key struct {
	score, load float64
	order       uint64
}

func (k key) beats(o key) bool {
	return k.score > o.score ||
		(k.score == o.score && (k.load < o.load || (k.load == o.load && k.order < o.order)))
}

func mix(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9
	z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB
	return z ^ (z >> 31)
}
