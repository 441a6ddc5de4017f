package scorer

import (
	"sync"

	kvix "github.com/kvix/kvix/client/go"
	"github.com/prometheus/client_golang/prometheus"
)

// live are the scorers the EPP runs (one per kvix-scorer entry of its configuration),
// which Collector reports on.
var live struct {
	sync.Mutex
	scorers map[*Scorer]bool
}

func track(s *Scorer, on bool) {
	live.Lock()
	defer live.Unlock()
	if live.scorers == nil {
		live.scorers = map[*Scorer]bool{}
	}
	if on {
		live.scorers[s] = true
	} else {
		delete(live.scorers, s)
	}
}

// A metric of the EPP's kvix-scorers: its description, and its value for one scorer.
type metric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(s *Scorer, n *kvix.Counters) float64
}

func counter(name, help string, value func(s *Scorer, n *kvix.Counters) float64) metric {
	return metric{prometheus.NewDesc(name, help, []string{"plugin"}, nil), prometheus.CounterValue, value}
}

// The EPP's kvix metrics, each declared here once; docs/operations.md's "Gateway API
// Inference Extension / llm-d" section ties the alerts of
// deploy/prometheus/kvix-epp-alerts.yml to them.
var (
	queries = prometheus.NewDesc("kvix_epp_queries_total",
		"Queries to kvix by outcome: scores, empty (no worker holds any of the prompt), or the request was scored without kvix (timeout, disconnected, rejected).",
		[]string{"plugin", "outcome"}, nil)
	metrics = []metric{
		{prometheus.NewDesc("kvix_epp_connected", "1 while the scorer is connected to a kvix-server, 0 while it fails open.",
			[]string{"plugin"}, nil), prometheus.GaugeValue,
			func(s *Scorer, _ *kvix.Counters) float64 {
				if s.client.Connected() {
					return 1
				}
				return 0
			}},
		counter("kvix_epp_connect_failures_total", "Connection attempts to kvix that failed (dial, handshake, re-announce).",
			func(_ *Scorer, n *kvix.Counters) float64 { return float64(n.ConnectFailures) }),
		counter("kvix_epp_tokenizer_failures_total", "Requests the tokenizer sidecar did not tokenize in time: scored by their bytes, which engine-fed workers never match.",
			func(s *Scorer, _ *kvix.Counters) float64 { return float64(s.tokenizerFailures.Load()) }),
		counter("kvix_epp_placements_dropped_total", "Placements not sent to kvix: the queue was full or the connection lost.",
			func(_ *Scorer, n *kvix.Counters) float64 { return float64(n.PlacementDrops) }),
		counter("kvix_epp_writes_refused_total", "Placements and reuse reports kvix refused (unknown worker, not authorized, rate limited).",
			func(_ *Scorer, n *kvix.Counters) float64 { return float64(n.WritesRefused + n.UnknownWorkers) }),
		counter("kvix_epp_stale_answers_total", "Answers of a kvix replica behind its log (healing, or stopped following it); the query went on to the next replica.",
			func(_ *Scorer, n *kvix.Counters) float64 { return float64(n.StaleAnswers) }),
		counter("kvix_epp_reuse_reports_dropped_total", "Reuse reports not sent to kvix: the queue was full or the connection lost.",
			func(_ *Scorer, n *kvix.Counters) float64 { return float64(n.ReuseDrops) }),
	}
)

// Collector reports the kvix-scorers of this process (those Factory built) to Prometheus: register it with
// GAIE's runner (WithCustomCollectors), as cmd/kvix-epp does, and the EPP's /metrics
// carries how kvix answered.
func Collector() prometheus.Collector { return collector{} }

type collector struct{}

func (collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- queries
	for _, m := range metrics {
		ch <- m.desc
	}
}

// Collect reports each plugin name once: scorers of one name (a configuration
// instantiated twice in one process, as tests do) are summed.
func (collector) Collect(ch chan<- prometheus.Metric) {
	live.Lock()
	byName := map[string][]*Scorer{}
	for s := range live.scorers {
		byName[s.typedName.Name] = append(byName[s.typedName.Name], s)
	}
	live.Unlock()
	for name, scorers := range byName {
		outcomes := make([]float64, kvix.ReasonRejected+1)
		values := make([]float64, len(metrics))
		for _, s := range scorers {
			n := s.client.Counters()
			for r := range outcomes {
				outcomes[r] += float64(n.Outcomes[kvix.Reason(r)])
			}
			for i, m := range metrics {
				values[i] += m.value(s, &n)
			}
		}
		for r, v := range outcomes {
			ch <- prometheus.MustNewConstMetric(queries, prometheus.CounterValue, v, name, kvix.Reason(r).String())
		}
		for i, m := range metrics {
			ch <- prometheus.MustNewConstMetric(m.desc, m.kind, values[i], name)
		}
	}
}
