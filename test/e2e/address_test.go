package e2e

import (
	"context"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// TestMasqueradeAddressRemoved, on every backend: the masquerade address taken off the node
// keeps the last good state (the datapath still masquerades to it) and the agent says so: the
// log names it, /readyz fails naming it (/healthz does not), and
// ip_masq_agent_masquerade_address_missing{address} is 1; `dump` shows the masqueradeCIDRs rule
// still masquerading to it (to:ADDR, read from the datapath), before and after. A configuration
// naming another address the node lacks is rejected meanwhile, naming it. Back on the node, the
// address is used again and the agent is ready.
func TestMasqueradeAddressRemoved(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if err := env.AddAltAddresses(ctx); err != nil {
			t.Fatal(err)
		}
		cfg := masqueradeAddresses + "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"
		ag := env.StartReady(ctx, t, b, cfg)
		env.Check(ctx, t, join(expect(Alt, "8.8.8.8", "10.10.10.10", "2001:4860:4860::8888"), expect(Keep, "10.1.2.3")), nil)
		wantDumpedAddress(ctx, t, env, b)

		if err := testutil.IPBatch(ctx, env.Node, "addr del "+NodeAlt4.String()+"/24 dev "+Uplink+"\n"); err != nil {
			t.Fatal(err)
		}
		if err := ag.WaitLog(ctx, 1, "a masquerade address of the configuration in force is not on the node",
			"masqueradeAddress 10.99.0.11 is not an address of the node's uplinks"); err != nil {
			t.Fatal(err)
		}
		if code, body, err := ag.Get(ctx, "/readyz"); err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, "10.99.0.11") {
			t.Errorf("/readyz with the address gone: %d %q %v, want 503 naming it", code, body, err)
		}
		if code, _, err := ag.Get(ctx, "/healthz"); err != nil || code != http.StatusOK {
			t.Errorf("/healthz with the address gone: %d %v, want 200", code, err)
		}
		wantMissing(ctx, t, ag, "10.99.0.11")
		b.Verify(ctx, t, env) // the last good state, masquerading to the address that is gone
		wantDumpedAddress(ctx, t, env, b)
		env.Check(ctx, t, expect(Alt, "2001:4860:4860::8888"), nil)

		rejected := ag.Count("config rejected")
		if err := env.Config.Write("masqueradeAddress: 10.99.0.77\n"); err != nil {
			t.Fatal(err)
		}
		if err := ag.WaitLog(ctx, rejected+1, "config rejected", "masqueradeAddress 10.99.0.77 is not an address of the node's uplinks"); err != nil {
			t.Fatal(err)
		}
		wantMissing(ctx, t, ag, "10.99.0.11", "10.99.0.77")
		b.Verify(ctx, t, env)

		// The file as it was, then the address back: used again, ready again.
		if err := env.Config.Write(cfg); err != nil {
			t.Fatal(err)
		}
		wantMissing(ctx, t, ag, "10.99.0.11")
		if err := testutil.IPBatch(ctx, env.Node, "addr add "+NodeAlt4.String()+"/24 dev "+Uplink+"\n"); err != nil {
			t.Fatal(err)
		}
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		wantMissing(ctx, t, ag)
		env.Check(ctx, t, join(expect(Alt, "8.8.8.8", "10.10.10.10", "2001:4860:4860::8888"), expect(Keep, "10.1.2.3")), nil)
		b.Verify(ctx, t, env)
	})
}

// wantDumpedAddress checks dump's rules for the test's configuration: the masqueradeCIDRs rule
// and the outbound rules masquerade to their family's masqueradeAddress (NodeAlt4, NodeAlt6),
// which every backend reads from what it installed; no RETURN rule shows an address.
func wantDumpedAddress(ctx context.Context, t *testing.T, env *Env, b Backend) {
	t.Helper()
	want := map[string]netip.Addr{}
	for _, r := range dumpTable(ctx, t, env, b) {
		switch {
		case r.key.Origin == string(policy.OriginMasqueradeCIDRs) || r.key.Origin == string(policy.OriginOutbound):
			addr := NodeAlt4
			if r.key.Family == policy.IPv6.String() {
				addr = NodeAlt6
			}
			want[r.key.Family+" "+r.key.Origin] = addr
			if r.to != addr {
				t.Errorf("dump: %s masquerades to %v, want to:%s", r.key, r.to, addr)
			}
		case r.key.Action == policy.Return.String() && r.to.IsValid():
			t.Errorf("dump: %s shows to:%s", r.key, r.to)
		}
	}
	for _, rule := range []string{"ipv4 " + string(policy.OriginMasqueradeCIDRs), "ipv4 " + string(policy.OriginOutbound), "ipv6 " + string(policy.OriginOutbound)} {
		if _, ok := want[rule]; !ok {
			t.Errorf("dump shows no %s rule", rule)
		}
	}
}

// wantMissing waits until ip_masq_agent_masquerade_address_missing has a series of value 1 for
// exactly these addresses.
func wantMissing(ctx context.Context, t *testing.T, ag *Agent, addrs ...string) {
	t.Helper()
	err := ag.poll(ctx, "masquerade_address_missing for "+strings.Join(addrs, ", "), func() (bool, error) {
		m, err := ag.Scrape(ctx)
		if err != nil {
			return false, err
		}
		series := m.Series(metrics.AddressMissing, nil)
		if len(series) != len(addrs) {
			return false, nil
		}
		for _, a := range addrs {
			if v, ok := m.Value(metrics.AddressMissing, Labels{"address": a}); !ok || v != 1 {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
