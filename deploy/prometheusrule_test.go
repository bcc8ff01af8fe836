package deploy

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
)

// ruleFile is the PrometheusRule's groups as the Prometheus rule file they are.
func ruleFile(t *testing.T) (*prometheusRule, []byte) {
	t.Helper()
	rule := one[*prometheusRule](t, manifests(t), "monitoring/prometheusrule.yaml")
	file, err := yaml.Marshal(rule.Spec)
	if err != nil {
		t.Fatal(err)
	}
	return rule, file
}

// The rules are a valid Prometheus rule file, checked as `promtool check rules` does: strict
// YAML, PromQL that parses, valid names, templates of labels and annotations that parse.
func TestPrometheusRuleChecks(t *testing.T) {
	_, file := ruleFile(t)
	groups, errs := rulefmt.Parse(file, false, model.UTF8Validation, parser.NewParser(parser.Options{}), nil)
	for _, err := range errs {
		t.Errorf("promtool check rules: %v", err)
	}
	if groups == nil || len(groups.Groups) != 2 {
		t.Fatalf("rule groups %+v", groups)
	}
}

// The alerts the fleet needs are all there, each with a severity and words for the person paged.
func TestPrometheusRuleAlerts(t *testing.T) {
	rule, _ := ruleFile(t)
	alerts := map[string]bool{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts[r.Alert] = true
			if !slices.Contains([]string{"critical", "warning", "info"}, r.Labels["severity"]) {
				t.Errorf("%s: severity %q", r.Alert, r.Labels["severity"])
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: annotations %v, want a summary and a description", r.Alert, r.Annotations)
			}
		}
	}
	for _, want := range []string{"IPMasqAgentConfigRejected", "IPMasqAgentNotReady", "IPMasqAgentFallbackBackend",
		"IPMasqAgentMasqueradeAddressMissing", "IPMasqAgentNATTableFull", "IPMasqAgentDriftPersisting",
		"IPMasqAgentPortAllocationFailures", "IPMasqAgentConfigObjectDeleted", "IPMasqAgentDown", "IPMasqAgentAbsent",
		"IPMasqAgentNodeStatusStale", "IPMasqAgentConfigDiverged", "IPMasqAgentRolloutHalted"} {
		if !alerts[want] {
			t.Errorf("no alert %s (have %v)", want, slices.Sorted(maps.Keys(alerts)))
		}
	}
}

// Every expression selects metrics the agent exports (or the file's own recording rules), matches
// and groups by labels they have (or the target labels the PodMonitor adds), and filters only on
// label values the agent emits: read from the parsed PromQL, not by pattern.
func TestPrometheusRuleQueriesExportedMetrics(t *testing.T) {
	rule, _ := ruleFile(t)
	labels := map[string][]string{} // metric or recording rule -> its labels
	for _, d := range append(metrics.Definitions(nil), metrics.RolloutDefinitions()...) {
		labels[d.Name] = d.Labels
	}
	labels["up"] = nil // Prometheus' own, one per target: only the target labels
	targetLabels := []string{"node", "job", "instance", "pod", "namespace"}
	promql := parser.NewParser(parser.Options{})
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			name := r.Alert + r.Record
			expr, err := promql.ParseExpr(r.Expr)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				continue
			}
			have := exprLabels(t, name, expr, labels, targetLabels)
			if r.Record != "" {
				labels[r.Record] = have // later rules may select it
			}
			// An alert's words name only labels its series have.
			for k, text := range r.Annotations {
				for _, m := range labelRef.FindAllStringSubmatch(text, -1) {
					if !slices.Contains(have, m[1]) {
						t.Errorf("%s: annotation %s names $labels.%s, which its series %v lack", name, k, m[1], have)
					}
				}
			}
		}
	}
}

var labelRef = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)

// exprLabels checks the selectors and groupings of expr (see TestPrometheusRuleQueriesExportedMetrics)
// and returns the labels of its result.
func exprLabels(t *testing.T, rule string, expr parser.Expr, known map[string][]string, target []string) []string {
	t.Helper()
	var out []string
	switch e := expr.(type) {
	case *parser.VectorSelector:
		metric, ok := known[e.Name]
		if !ok {
			t.Errorf("%s selects %s, which neither the agent nor an earlier rule exports", rule, e.Name)
		}
		out = append(slices.Clone(metric), target...)
		for _, m := range e.LabelMatchers {
			if m.Name != model.MetricNameLabel && !slices.Contains(out, m.Name) {
				t.Errorf("%s matches %s on %s, which it does not have", rule, e.Name, m.Name)
			}
		}
		return out
	case *parser.AggregateExpr:
		in := exprLabels(t, rule, e.Expr, known, target)
		for _, l := range e.Grouping {
			if !slices.Contains(in, l) {
				t.Errorf("%s groups by %s, which %s does not have", rule, l, e.Expr)
			}
		}
		if e.Without {
			return slices.DeleteFunc(in, func(l string) bool { return slices.Contains(e.Grouping, l) })
		}
		return e.Grouping
	case *parser.Call:
		for _, arg := range e.Args {
			out = exprLabels(t, rule, arg, known, target)
		}
		return out
	case *parser.MatrixSelector:
		return exprLabels(t, rule, e.VectorSelector, known, target)
	case *parser.BinaryExpr:
		lhs := exprLabels(t, rule, e.LHS, known, target)
		rhs := exprLabels(t, rule, e.RHS, known, target)
		if e.LHS.Type() == parser.ValueTypeScalar {
			return rhs // scalar op vector: the vector's labels
		}
		return lhs
	case *parser.ParenExpr:
		return exprLabels(t, rule, e.Expr, known, target)
	case *parser.NumberLiteral, *parser.StringLiteral:
		return nil
	}
	t.Errorf("%s: no check for %T in %s", rule, expr, fmt.Sprint(expr))
	return nil
}
