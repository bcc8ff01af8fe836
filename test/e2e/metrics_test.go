package e2e

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Configurations of TestMetrics. The reload keeps 10.0.0.0/8 (and moves it, since a
// masqueradeCIDRs entry comes in before it) and changes 10.10.10.10/32 to 10.10.10.0/24.
const (
	metricsConfigA = `masqueradeCIDRs: [10.10.10.10/32]
nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, fc00::/7]
`
	metricsConfigB = `masqueradeCIDRs: [192.168.1.0/24, 10.10.10.0/24]
nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, fc00::/7]
`
)

// payload is what each datagram carries: 8 bytes, so a datagram is 20+8+8 bytes over IPv4 and
// 40+8+8 over IPv6.
var payload = []byte("metrics\n")

func datagramBytes(dst netip.Addr) float64 {
	if dst.Is4() {
		return float64(20 + 8 + len(payload))
	}
	return float64(40 + 8 + len(payload))
}

func ruleKey(fam policy.Family, action policy.Action, cidr string, origin policy.Origin) RuleKey {
	return RuleKey{fam.String(), action.String(), cidr, string(origin)}
}

// Rules of configuration A (with --enable-ipv6), as the metrics label them.
var (
	ruleMasqVIP    = ruleKey(policy.IPv4, policy.Masquerade, "10.10.10.10/32", policy.OriginMasqueradeCIDRs)
	ruleMasqVIPNet = ruleKey(policy.IPv4, policy.Masquerade, "10.10.10.0/24", policy.OriginMasqueradeCIDRs)
	ruleMasq192    = ruleKey(policy.IPv4, policy.Masquerade, "192.168.1.0/24", policy.OriginMasqueradeCIDRs)
	ruleLinkLocal4 = ruleKey(policy.IPv4, policy.Return, "169.254.0.0/16", policy.OriginLinkLocal)
	rule10         = ruleKey(policy.IPv4, policy.Return, "10.0.0.0/8", policy.OriginNonMasqueradeCIDRs)
	rule172        = ruleKey(policy.IPv4, policy.Return, "172.16.0.0/12", policy.OriginNonMasqueradeCIDRs)
	ruleOut4       = ruleKey(policy.IPv4, policy.Masquerade, "0.0.0.0/0", policy.OriginOutbound)
	ruleLinkLocal6 = ruleKey(policy.IPv6, policy.Return, "fe80::/10", policy.OriginLinkLocal)
	ruleFC00       = ruleKey(policy.IPv6, policy.Return, "fc00::/7", policy.OriginNonMasqueradeCIDRs)
	ruleOut6       = ruleKey(policy.IPv6, policy.Masquerade, "::/0", policy.OriginOutbound)
)

// sends are datagrams to send: destination -> how many, each a new flow.
type sends map[string]int

// send sends the datagrams and returns the expected growth of each rule's counters. The rule
// each destination hits is given with it; the observed source confirms that rule's action.
func send(ctx context.Context, t *testing.T, env *Env, s sends, hits map[string]RuleKey) map[RuleKey]RuleCount {
	t.Helper()
	want := map[RuleKey]RuleCount{}
	for _, dst := range slices.Sorted(maps.Keys(s)) {
		addr := netip.MustParseAddr(dst)
		k := hits[dst]
		for range s[dst] {
			src, err := env.Datagram(ctx, addr, payload)
			if err != nil {
				t.Fatal(err)
			}
			masqueraded := src.Addr() == NodeAddr(policy.FamilyOf(addr))
			if masqueraded != (k.Action == policy.Masquerade.String()) {
				t.Fatalf("datagram to %s: source %s, but it should hit %s", dst, src, k)
			}
		}
		c := want[k]
		c.Packets += float64(s[dst])
		c.Bytes += float64(s[dst]) * datagramBytes(addr)
		want[k] = c
	}
	return want
}

// checkGrowth checks that every rule grew by exactly want (zero when absent) between two scrapes,
// and that before and after have the same rules. The IPv6 link-local rule may see the node's
// own neighbour discovery, so only its growth from this test is a lower bound.
func checkGrowth(t *testing.T, before, after map[RuleKey]RuleCount, want map[RuleKey]RuleCount) {
	t.Helper()
	if !slices.Equal(slices.SortedFunc(maps.Keys(before), cmpKey), slices.SortedFunc(maps.Keys(after), cmpKey)) {
		t.Errorf("rules changed between scrapes:\n%v\n%v", slices.Collect(maps.Keys(before)), slices.Collect(maps.Keys(after)))
	}
	for k := range want {
		if _, ok := after[k]; !ok {
			t.Errorf("no series for %s", k)
		}
	}
	for k, a := range after {
		b, w := before[k], want[k]
		got := RuleCount{a.Packets - b.Packets, a.Bytes - b.Bytes}
		if k == ruleLinkLocal6 {
			if got.Packets < w.Packets {
				t.Errorf("%s: grew by %v, want at least %v", k, got, w)
			}
			continue
		}
		if got != w {
			t.Errorf("%s: grew by %v packets / %v bytes, want exactly %v / %v", k, got.Packets, got.Bytes, w.Packets, w.Bytes)
		}
	}
}

func cmpKey(a, b RuleKey) int { return strings.Compare(a.String(), b.String()) }

// scrapeUntil scrapes until cond holds.
func scrapeUntil(ctx context.Context, t *testing.T, ag *Agent, what string, cond func(Metrics) bool) Metrics {
	t.Helper()
	var m Metrics
	if err := testutil.Poll(10*time.Second, 10*time.Millisecond, func() error {
		var err error
		if m, err = ag.Scrape(ctx); err != nil || cond(m) {
			return err
		}
		return testutil.NotYet("%s: the scrape had %v", what, m.Series("ip_masq_agent_config_reloads_total", nil))
	}); err != nil {
		t.Fatal(err)
	}
	return m
}

func configHash(t *testing.T, doc string) string {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	return agent.ConfigHash(cfg)
}

// dumpRow is a row of dump's rules: the rule's series, its counters and the address it
// masquerades to (the to:ADDR column; invalid without one).
type dumpRow struct {
	key   RuleKey
	count RuleCount
	to    netip.Addr
}

// dumpTable runs `dump` in the node, as a second process, and returns the rows of its rules.
func dumpTable(ctx context.Context, t *testing.T, env *Env, b Backend) []dumpRow {
	t.Helper()
	args := append(env.DatapathArgs("dump", b), "--config="+env.Config.Path())
	out, err := NSExec(ctx, env.Node, "", env.Bin, args...)
	if err != nil {
		t.Fatalf("dump: %v\n%s", err, out)
	}
	var rows []dumpRow
	header := false
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 7 && f[0] == "FAMILY" {
			header = true
			continue
		}
		if !header || len(f) != 7 && (len(f) != 8 || !strings.HasPrefix(f[7], "to:")) {
			continue
		}
		// ORIGIN is written as the rule's source (nonMasqueradeCIDRs[1]); the metrics' origin
		// label is the part before the index.
		origin, _, _ := strings.Cut(f[4], "[")
		packets, err1 := strconv.ParseFloat(f[5], 64)
		bytes, err2 := strconv.ParseFloat(f[6], 64)
		var to netip.Addr
		var err3 error
		if len(f) == 8 {
			to, err3 = netip.ParseAddr(strings.TrimPrefix(f[7], "to:"))
		}
		if err1 != nil || err2 != nil || err3 != nil {
			t.Fatalf("dump row %q", l)
		}
		rows = append(rows, dumpRow{RuleKey{f[0], f[2], f[3], origin}, RuleCount{packets, bytes}, to})
	}
	if len(rows) == 0 {
		t.Fatalf("dump printed no rules:\n%s", out)
	}
	t.Logf("dump:\n%s", out)
	return rows
}

// dumpRules is dumpTable's counters by series.
func dumpRules(ctx context.Context, t *testing.T, env *Env, b Backend) map[RuleKey]RuleCount {
	t.Helper()
	rows := map[RuleKey]RuleCount{}
	for _, r := range dumpTable(ctx, t, env, b) {
		rows[r.key] = r.count
	}
	return rows
}

// TestMetrics, for every backend: a known number of single-datagram flows to destinations that
// hit known rules makes exactly those rules' packet and byte counters on /metrics grow by that
// much; a reload that keeps a rule (moving it) and changes another keeps the kept rule's
// counters; so does an agent restart; `dump`, run as a second process while the agent runs
// and after it stopped, shows the same counters; and the agent's own metrics follow reloads.
func TestMetrics(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, metricsConfigA)

		// What runs, and the configuration in force.
		m, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v, ok := m.Value("ip_masq_agent_datapath_info", Labels{"backend": b.Info.Backend, "attach_mode": b.Info.AttachMode}); !ok || v != 1 {
			t.Errorf("datapath_info: %v", m.Series("ip_masq_agent_datapath_info", nil))
		}
		if v, ok := m.Value("ip_masq_agent_config_info", Labels{"sha256": configHash(t, metricsConfigA)}); !ok || v != 1 {
			t.Errorf("config_info %v, want the hash of configuration A", m.Series("ip_masq_agent_config_info", nil))
		}
		if len(m.Series("ip_masq_agent_build_info", nil)) != 1 {
			t.Errorf("build_info %v", m.Series("ip_masq_agent_build_info", nil))
		}
		if hasNAT := m["ip_masq_agent_nat_entries"] != nil || m["ip_masq_agent_nat_port_allocation_retries_total"] != nil; hasNAT != b.NAT {
			t.Errorf("NAT metrics exported: %v, want %v", hasNAT, b.NAT)
		}
		if h := m["ip_masq_agent_datapath_sync_duration_seconds"].GetMetric(); len(h) != 1 || h[0].GetHistogram().GetSampleCount() < 1 {
			t.Errorf("sync duration histogram %v", h)
		}

		// Neighbours resolved before counting, so no datagram is lost to them.
		for _, dst := range []string{"8.8.8.8", "2001:db8::1"} {
			if _, err := env.Datagram(ctx, netip.MustParseAddr(dst), payload); err != nil {
				t.Fatal(err)
			}
		}
		hits := map[string]RuleKey{
			"10.10.10.10": ruleMasqVIP, "10.1.2.3": rule10, "172.16.5.5": rule172, "8.8.8.8": ruleOut4,
			"fd00::1": ruleFC00, "2001:db8::1": ruleOut6, "2001:4860:4860::8888": ruleOut6,
		}
		m0, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		before := m0.Rules()
		for _, k := range []RuleKey{ruleMasqVIP, ruleLinkLocal4, rule10, rule172, ruleOut4, ruleLinkLocal6, ruleFC00, ruleOut6} {
			if _, ok := before[k]; !ok {
				t.Errorf("no series for %s: %v", k, slices.Collect(maps.Keys(before)))
			}
		}
		want := send(ctx, t, env, sends{"10.10.10.10": 3, "10.1.2.3": 2, "172.16.5.5": 1, "8.8.8.8": 4,
			"fd00::1": 2, "2001:db8::1": 1, "2001:4860:4860::8888": 2}, hits)
		m1, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		counted := m1.Rules()
		checkGrowth(t, before, counted, want)

		// dump, a second process, reads the same counters from the kernel.
		dumped := dumpRules(ctx, t, env, b)
		if len(dumped) != len(counted) {
			t.Errorf("dump shows %d rules, /metrics %d", len(dumped), len(counted))
		}
		for k, d := range dumped {
			if c, ok := counted[k]; !ok || (c != d && k != ruleLinkLocal6) {
				t.Errorf("dump shows %s %v, /metrics %v", k, d, c)
			}
		}

		// A bad file is counted and changes nothing.
		if err := env.Config.Write("masqueradeCIDRs: [10.10.10.10/24]\n"); err != nil {
			t.Fatal(err)
		}
		scrapeUntil(ctx, t, ag, "the bad file counted", func(m Metrics) bool {
			v, _ := m.Value("ip_masq_agent_config_reloads_total", Labels{"result": "invalid"})
			return v == 1
		})

		// The reload: 10.0.0.0/8 stays (one place down), 10.10.10.10/32 becomes /24.
		if err := env.Config.Write(metricsConfigB); err != nil {
			t.Fatal(err)
		}
		env.SetGood(metricsConfigB, false)
		m2 := scrapeUntil(ctx, t, ag, "configuration B in force", func(m Metrics) bool {
			_, ok := m.Value("ip_masq_agent_config_info", Labels{"sha256": configHash(t, metricsConfigB)})
			return ok
		})
		b.Verify(ctx, t, env)
		reloaded := m2.Rules()
		for _, k := range []RuleKey{ruleLinkLocal4, rule10, rule172, ruleOut4, ruleFC00, ruleOut6} {
			if reloaded[k] != counted[k] {
				t.Errorf("%s kept through the reload: %v, before it %v", k, reloaded[k], counted[k])
			}
		}
		if c, ok := reloaded[ruleMasqVIP]; ok {
			t.Errorf("the changed rule %s is still exported: %v", ruleMasqVIP, c)
		}
		for _, k := range []RuleKey{ruleMasqVIPNet, ruleMasq192} {
			if c, ok := reloaded[k]; !ok || c != (RuleCount{}) {
				t.Errorf("new rule %s: %v (exported %v), want zero", k, c, ok)
			}
		}
		if v, _ := m2.Value("ip_masq_agent_config_reloads_total", Labels{"result": "success"}); v < 2 {
			t.Errorf("successful reloads %v, want at least 2", v)
		}
		if v, _ := m2.Value("ip_masq_agent_config_last_reload_success_timestamp_seconds", Labels{}); v < float64(time.Now().Add(-time.Minute).Unix()) {
			t.Errorf("last reload timestamp %v", v)
		}

		// Traffic after the reload counts on top.
		hits["10.10.10.10"] = ruleMasqVIPNet
		hits["192.168.1.1"] = ruleMasq192
		want = send(ctx, t, env, sends{"10.10.10.10": 2, "10.1.2.3": 1, "192.168.1.1": 1}, hits)
		m3, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		counted = m3.Rules()
		checkGrowth(t, reloaded, counted, want)

		// The agent stops: dump still reads the counters. A new agent keeps them.
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		dumped = dumpRules(ctx, t, env, b)
		if len(dumped) != len(counted) {
			t.Errorf("dump after the agent stopped shows %d rules, the last scrape %d", len(dumped), len(counted))
		}
		for k, d := range dumped {
			if c, ok := counted[k]; !ok || (c != d && k != ruleLinkLocal6) {
				t.Errorf("dump after the agent stopped shows %s %v, the last scrape %v", k, d, c)
			}
		}
		ag = env.StartAgent(ctx, t, b)
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		m4, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		checkGrowth(t, counted, m4.Rules(), nil)
		if v, _ := m4.Value("ip_masq_agent_scrape_errors_total", Labels{"source": "rules"}); v != 0 {
			t.Errorf("scrape errors: %v", v)
		}
		b.Verify(ctx, t, env)
		t.Logf("rules after the restart: %v", fmt.Sprint(m4.Rules()))
	})
}
