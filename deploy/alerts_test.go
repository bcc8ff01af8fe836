package deploy

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
)

// step is the scrape interval of the recorded series (the PodMonitor's) and of the rules'
// evaluation.
const step = 30 * time.Second

// job is the job label the Prometheus Operator gives the PodMonitor's targets.
const job = `job="kube-system/ip-masq-agent"`

// series is the promqltest notation of a series scraped every step for span, of value at(t).
func series(sel string, span time.Duration, at func(t time.Duration) float64) string {
	var vals []string
	for t := time.Duration(0); t <= span; t += step {
		vals = append(vals, fmt.Sprint(at(t)))
	}
	return sel + " " + strings.Join(vals, " ")
}

func always(v float64) func(time.Duration) float64 { return func(time.Duration) float64 { return v } }

// change is a series' value from a time on.
type change struct {
	at time.Duration
	v  float64
}

// from is v before the first change, then each change's value from its time on.
func from(v float64, changes ...change) func(time.Duration) float64 {
	return func(t time.Duration) float64 {
		out := v
		for _, c := range changes {
			if t >= c.at {
				out = c.v
			}
		}
		return out
	}
}

// until is v before d, then after.
func until(d time.Duration, v, after float64) func(time.Duration) float64 {
	return from(v, change{d, after})
}

// firing runs the file's alert name over the recorded series, as Prometheus' rule engine does
// (evaluated every step for span, its for: included), and returns the labels of its alerts
// that fired at any evaluation, sorted.
func firing(t *testing.T, name string, span time.Duration, recorded ...string) []string {
	t.Helper()
	rule, _ := ruleFile(t)
	var alert *rules.AlertingRule
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != name {
				continue
			}
			expr, err := parser.NewParser(parser.Options{}).ParseExpr(r.Expr)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			var hold model.Duration
			if r.For != "" {
				if hold, err = model.ParseDuration(r.For); err != nil {
					t.Fatalf("%s: for: %v", name, err)
				}
			}
			alert = rules.NewAlertingRule(name, expr, time.Duration(hold), 0, labels.FromMap(r.Labels), labels.FromMap(r.Annotations),
				labels.EmptyLabels(), "", true, nil)
		}
	}
	if alert == nil {
		t.Fatalf("no alert %s", name)
	}
	storage := promqltest.LoadedStorage(t, "load "+step.String()+"\n  "+strings.Join(recorded, "\n  "))
	query := rules.EngineQueryFunc(promqltest.NewTestEngine(t, false, 0, promqltest.DefaultMaxSamplesPerQuery), storage)
	var out []string
	for at := time.Duration(0); at <= span; at += step {
		if _, err := alert.Eval(context.Background(), 0, time.Unix(0, 0).Add(at), query, nil, 0); err != nil {
			t.Fatalf("%s at %v: %v", name, at, err)
		}
		for _, a := range alert.ActiveAlerts() {
			if l := a.Labels.String(); a.State == rules.StateFiring && !slices.Contains(out, l) {
				out = append(out, l)
			}
		}
	}
	slices.Sort(out)
	return out
}

// Each alert about silence and about the fleet's configuration fires on the series of its
// trouble, with the node it concerns, and stays silent on healthy series and on trouble shorter
// than its window.
func TestAlertsFire(t *testing.T) {
	const hour = time.Hour
	heartbeat := 300.0
	// A status written every heartbeat: the last write is the latest multiple of it.
	beating := func(t time.Duration) float64 { return float64(int(t.Seconds()/heartbeat)) * heartbeat }
	for _, tt := range []struct {
		name, alert string
		span        time.Duration
		recorded    []string
		want        []string // label sets of the firing alerts; none: silent
	}{
		{"object deleted", "IPMasqAgentConfigObjectDeleted", 15 * time.Minute, []string{
			series(`ip_masq_agent_config_source_deleted{node="a",`+job+`}`, 15*time.Minute, until(2*time.Minute, 0, 1)),
			series(`ip_masq_agent_config_source_deleted{node="b",`+job+`}`, 15*time.Minute, until(2*time.Minute, 0, 1)),
		}, []string{`{alertname="IPMasqAgentConfigObjectDeleted", severity="warning"}`}},
		{"object there", "IPMasqAgentConfigObjectDeleted", 15 * time.Minute, []string{
			series(`ip_masq_agent_config_source_deleted{node="a",`+job+`}`, 15*time.Minute, always(0)),
		}, nil},
		{"object deleted and created again within minutes", "IPMasqAgentConfigObjectDeleted", 15 * time.Minute, []string{
			series(`ip_masq_agent_config_source_deleted{node="a",`+job+`}`, 15*time.Minute, from(0, change{3 * time.Minute, 1}, change{6 * time.Minute, 0})),
		}, nil},

		{"agent down", "IPMasqAgentDown", 15 * time.Minute, []string{
			series(`up{node="a",`+job+`}`, 15*time.Minute, until(5*time.Minute, 1, 0)),
			series(`up{node="b",`+job+`}`, 15*time.Minute, always(1)),
		}, []string{`{alertname="IPMasqAgentDown", node="a", severity="critical"}`}},
		{"agents up", "IPMasqAgentDown", 15 * time.Minute, []string{
			series(`up{node="a",`+job+`}`, 15*time.Minute, always(1)),
			series(`up{node="b",`+job+`}`, 15*time.Minute, from(1, change{5 * time.Minute, 0}, change{8 * time.Minute, 1})),
		}, nil},

		{"no agent scraped", "IPMasqAgentAbsent", 30 * time.Minute, []string{
			series(`up{node="a",job="kube-system/kube-proxy"}`, 30*time.Minute, always(1)),
			series(`up{node="a",`+job+`}`, 5*time.Minute, always(1)), // the DaemonSet deleted at 5m
		}, []string{`{alertname="IPMasqAgentAbsent", severity="critical"}`}},
		{"agents scraped", "IPMasqAgentAbsent", 30 * time.Minute, []string{
			series(`up{node="a",`+job+`}`, 30*time.Minute, always(1)),
		}, nil},

		{"status not renewed", "IPMasqAgentNodeStatusStale", hour, []string{
			series(`ip_masq_agent_node_status_last_write_timestamp_seconds{node="a",`+job+`}`, hour, until(10*time.Minute, 0, 600)),
			series(`ip_masq_agent_node_status_heartbeat_interval_seconds{node="a",`+job+`}`, hour, always(heartbeat)),
			series(`ip_masq_agent_node_status_last_write_timestamp_seconds{node="b",`+job+`}`, hour, beating),
			series(`ip_masq_agent_node_status_heartbeat_interval_seconds{node="b",`+job+`}`, hour, always(heartbeat)),
		}, []string{`{alertname="IPMasqAgentNodeStatusStale", node="a", severity="warning"}`}},
		{"status renewed", "IPMasqAgentNodeStatusStale", hour, []string{
			series(`ip_masq_agent_node_status_last_write_timestamp_seconds{node="b",`+job+`}`, hour, beating),
			series(`ip_masq_agent_node_status_heartbeat_interval_seconds{node="b",`+job+`}`, hour, always(heartbeat)),
			// A longer heartbeat is judged by its own period.
			series(`ip_masq_agent_node_status_last_write_timestamp_seconds{node="c",`+job+`}`, hour, until(30*time.Minute, 0, 1800)),
			series(`ip_masq_agent_node_status_heartbeat_interval_seconds{node="c",`+job+`}`, hour, always(1800)),
		}, nil},

		{"configurations diverge", "IPMasqAgentConfigDiverged", hour, []string{
			series(`ip_masq_agent_config_info{node="a",sha256="aaaa",`+job+`}`, hour, always(1)),
			series(`ip_masq_agent_config_info{node="b",sha256="bbbb",`+job+`}`, hour, always(1)),
			series(`ip_masq_agent_config_info{node="c",sha256="aaaa",`+job+`}`, hour, always(1)),
		}, []string{`{alertname="IPMasqAgentConfigDiverged", severity="warning"}`}},
		{"one configuration, and a rollout", "IPMasqAgentConfigDiverged", hour, []string{
			series(`ip_masq_agent_config_info{node="a",sha256="aaaa",`+job+`}`, 20*time.Minute, always(1)),
			series(`ip_masq_agent_config_info{node="b",sha256="aaaa",`+job+`}`, 25*time.Minute, always(1)),
			// Node a takes the new configuration at 20m, node b 5 minutes later.
			`ip_masq_agent_config_info{node="a",sha256="bbbb",` + job + `} _x40 ` + strings.Repeat("1 ", 80),
			`ip_masq_agent_config_info{node="b",sha256="bbbb",` + job + `} _x50 ` + strings.Repeat("1 ", 70),
		}, nil},
		{"configurations diverge while a rollout progresses", "IPMasqAgentConfigDiverged", hour, []string{
			series(`ip_masq_agent_config_info{node="a",sha256="aaaa",`+job+`}`, hour, always(1)),
			series(`ip_masq_agent_config_info{node="b",sha256="bbbb",`+job+`}`, hour, always(1)),
			series(`ip_masq_agent_rollout_phase{phase="Progressing",job="kube-system/ip-masq-agent-rollout"}`, hour, always(1)),
			series(`ip_masq_agent_rollout_phase{phase="Halted",job="kube-system/ip-masq-agent-rollout"}`, hour, always(0)),
		}, nil},
		{"a halted rollout", "IPMasqAgentRolloutHalted", hour, []string{
			series(`ip_masq_agent_rollout_phase{phase="Halted",job="kube-system/ip-masq-agent-rollout"}`, hour, func(t time.Duration) float64 {
				return map[bool]float64{true: 1}[t >= 30*time.Minute]
			}),
		}, []string{`{alertname="IPMasqAgentRolloutHalted", severity="warning"}`}},
		{"a rollout that halts for a moment", "IPMasqAgentRolloutHalted", hour, []string{
			series(`ip_masq_agent_rollout_phase{phase="Halted",job="kube-system/ip-masq-agent-rollout"}`, hour, func(t time.Duration) float64 {
				return map[bool]float64{true: 1}[t >= 30*time.Minute && t < 30*time.Minute+30*time.Second]
			}),
		}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := firing(t, tt.alert, tt.span, tt.recorded...); !slices.Equal(got, tt.want) {
				t.Errorf("%s fires %q, want %q", tt.alert, got, tt.want)
			}
		})
	}
}
