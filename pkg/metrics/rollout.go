package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// The rollout controller's metrics (ip-masq-agent rollout).
const (
	RolloutGeneration       = Namespace + "_rollout_generation"
	RolloutStableGeneration = Namespace + "_rollout_stable_generation"
	RolloutPhase            = Namespace + "_rollout_phase"
	RolloutWave             = Namespace + "_rollout_wave"
	RolloutNodes            = Namespace + "_rollout_nodes"
)

// RolloutDefinitions returns every metric the rollout controller exports, besides the go_* and
// process_* ones.
func RolloutDefinitions() []Definition {
	return []Definition{
		{RolloutGeneration, "gauge", nil, "The IPMasqAgentConfig generation being rolled out, or last rolled out."},
		{RolloutStableGeneration, "gauge", nil, "The generation every node not yet released applies: the last one rolled out to all."},
		{RolloutPhase, "gauge", []string{"phase"}, "1 for the rollout's phase (Progressing, Halted, Complete), 0 for the others."},
		{RolloutWave, "gauge", []string{"of"}, "How many waves of the rollout are out; of is how many there are."},
		{RolloutNodes, "gauge", []string{"state"}, "Nodes that run an agent (state total), and those that applied the generation rolled out (state updated)."},
	}
}

// rolloutCollector reads the controller's state at each scrape.
type rolloutCollector struct {
	state func() *kube.Rollout
	descs map[string]*prometheus.Desc
}

// NewRolloutRegistry returns a registry of the rollout controller's metrics, read from state
// (nil before the controller's first step), and the Go runtime and process collectors.
func NewRolloutRegistry(state func() *kube.Rollout) (*prometheus.Registry, error) {
	c := &rolloutCollector{state: state, descs: map[string]*prometheus.Desc{}}
	for _, d := range RolloutDefinitions() {
		c.descs[d.Name] = prometheus.NewDesc(d.Name, d.Help, d.Labels, nil)
	}
	reg := prometheus.NewRegistry()
	for _, col := range []prometheus.Collector{c, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return reg, nil
}

func (c *rolloutCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c *rolloutCollector) Collect(ch chan<- prometheus.Metric) {
	r := c.state()
	if r == nil {
		return
	}
	gauge := func(name string, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(c.descs[name], prometheus.GaugeValue, v, labels...)
	}
	gauge(RolloutGeneration, float64(r.Generation))
	if r.Stable != nil {
		gauge(RolloutStableGeneration, float64(r.Stable.Generation))
	}
	for _, p := range []string{kube.RolloutProgressing, kube.RolloutHalted, kube.RolloutComplete} {
		gauge(RolloutPhase, boolValue(r.Phase == p), p)
	}
	gauge(RolloutWave, float64(r.Wave), strconv.Itoa(r.Waves))
	gauge(RolloutNodes, float64(r.Nodes), "total")
	gauge(RolloutNodes, float64(r.Updated), "updated")
}
