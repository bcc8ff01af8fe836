package e2e

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics is one scrape of the agent's /metrics, by metric family name.
type Metrics map[string]*dto.MetricFamily

// Scrape fetches /metrics from the agent (inside the node namespace) and parses it.
func (a *Agent) Scrape(ctx context.Context) (Metrics, error) {
	code, body, err := a.Get(ctx, "/metrics")
	if err != nil {
		return nil, fmt.Errorf("scrape: %w", err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("scrape: status %d: %s", code, body)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse scrape: %w", err)
	}
	return fams, nil
}

// Labels are a series' labels.
type Labels map[string]string

func labelsOf(m *dto.Metric) Labels {
	out := Labels{}
	for _, l := range m.Label {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// value is a counter's or a gauge's value.
func value(m *dto.Metric) float64 {
	if c := m.GetCounter(); c != nil {
		return c.GetValue()
	}
	return m.GetGauge().GetValue()
}

// Series returns the series of a metric whose labels include match, with their values.
func (m Metrics) Series(name string, match Labels) map[string]float64 {
	out := map[string]float64{}
	for _, s := range m[name].GetMetric() {
		ls := labelsOf(s)
		ok := true
		for k, v := range match {
			if ls[k] != v {
				ok = false
			}
		}
		if ok {
			out[fmt.Sprint(ls)] = value(s)
		}
	}
	return out
}

// Value returns the value of the one series of a metric with exactly these labels.
func (m Metrics) Value(name string, labels Labels) (float64, bool) {
	for _, s := range m[name].GetMetric() {
		if fmt.Sprint(labelsOf(s)) == fmt.Sprint(labels) {
			return value(s), true
		}
	}
	return 0, false
}

// RuleKey identifies a per-rule series.
type RuleKey struct {
	Family, Action, CIDR, Origin string
}

func (k RuleKey) String() string {
	return fmt.Sprintf("%s %s %s (%s)", k.Family, k.Action, k.CIDR, k.Origin)
}

// RuleCount is a rule's packets and bytes.
type RuleCount struct {
	Packets, Bytes float64
}

// Rules returns the per-rule counters of the scrape.
func (m Metrics) Rules() map[RuleKey]RuleCount {
	out := map[RuleKey]RuleCount{}
	for _, name := range []string{"ip_masq_agent_rule_packets_total", "ip_masq_agent_rule_bytes_total"} {
		for _, s := range m[name].GetMetric() {
			ls := labelsOf(s)
			k := RuleKey{ls["family"], ls["action"], ls["cidr"], ls["origin"]}
			c := out[k]
			if strings.Contains(name, "packets") {
				c.Packets = value(s)
			} else {
				c.Bytes = value(s)
			}
			out[k] = c
		}
	}
	return out
}
