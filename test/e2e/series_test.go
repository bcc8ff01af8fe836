package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// manyCIDRs is a configuration of n non-masquerade CIDRs (11.a.b.c/32, none of the topology's
// destinations), cidrLimit raised to match.
func manyCIDRs(n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "cidrLimit: %d\nnonMasqueradeCIDRs:\n", n)
	for i := range n {
		fmt.Fprintf(&b, "  - 11.%d.%d.%d/32\n", i>>16, i>>8&255, i&255)
	}
	return b.String()
}

// seriesBound reads the documented bound of a node's series from docs/reference.md's Metrics
// section: the row of the series table for the given number of CIDRs, default limit.
func seriesBound(t *testing.T, cidrs string) int {
	t.Helper()
	data, err := os.ReadFile("../../docs/reference.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile(`(?m)^\| ` + regexp.QuoteMeta(cidrs) + ` \| at most ([0-9,]+) \|`).FindSubmatch(data)
	if row == nil {
		t.Fatalf("docs/reference.md has no row of series for %s CIDRs", cidrs)
	}
	n, err := strconv.Atoi(strings.ReplaceAll(string(row[1]), ",", ""))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSeriesPerNode: at 10k CIDRs a node's /metrics holds no more series than docs/reference.md
// says, on every backend: the per-rule series are bounded by default (--rule-metrics-limit), and
// the per-origin totals count every rule. It prints what it counted.
func TestSeriesPerNode(t *testing.T) {
	const cidrs = 10_000
	cfg := manyCIDRs(cidrs)
	bound := seriesBound(t, "10k")
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, cfg)
		code, body, err := ag.Get(ctx, "/metrics")
		if err != nil || code != http.StatusOK {
			t.Fatalf("scrape: %d, %v", code, err)
		}
		all, own, perRule := 0, 0, 0
		for _, line := range strings.Split(body, "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			all++ // one sample line, one series
			if strings.HasPrefix(line, "ip_masq_agent_") {
				own++
			}
			if strings.HasPrefix(line, "ip_masq_agent_rule_packets_total{") || strings.HasPrefix(line, "ip_masq_agent_rule_bytes_total{") {
				perRule++
			}
		}
		m, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s, %d CIDRs: %d series per node (%d ip_masq_agent_*, %d of them per rule), %d bytes a scrape",
			b.Name, cidrs, all, own, perRule, len(body))
		if all > bound {
			t.Errorf("%d series, docs/reference.md says at most %d", all, bound)
		}
		if v, _ := m.Value("ip_masq_agent_rules", Labels{"family": "ipv4"}); v != cidrs+2 {
			t.Errorf("ipv4 rules %v, want %d (the CIDRs, link-local and outbound)", v, cidrs+2)
		}
	})
}
