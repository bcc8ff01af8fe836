package iptables_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestCheckDrift: nothing before the first apply; a deleted or doubled jump is "jump", a
// flushed, changed or deleted chain is "chain", in either family; an apply repairs each; the
// check lists two chains per family and never dumps the table, unless the iptables command is
// missing, where it falls back to the save tool.
func TestCheckDrift(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true})
	check := func(want ...string) {
		t.Helper()
		got, err := b.CheckDrift(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("CheckDrift = %q, want %q", got, want)
		}
	}
	heal := func() {
		t.Helper()
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		check()
	}
	check()
	heal()
	before := len(f.Calls)
	check()
	for _, c := range f.Calls[before:] {
		if strings.HasSuffix(c.Name, "-save") || strings.HasSuffix(c.Name, "-restore") || !slices.Contains(c.Args, "-S") {
			t.Errorf("the check ran %s %q", c.Name, c.Args)
		}
	}
	if n := len(f.Calls) - before; n != 4 {
		t.Errorf("the check ran %d commands, want 4 (two chains, two families)", n)
	}

	for _, fam := range policy.Families() {
		// A restore replaces the table: look it up afresh each time.
		nat := func() *iptablestest.Table { return f.NAT(iptables.ModeNFT, fam) }
		nat().Rules["POSTROUTING"] = nil
		check(datapath.DriftJump)
		heal()
		nat().Rules["POSTROUTING"] = append(nat().Rules["POSTROUTING"], nat().Rules["POSTROUTING"]...)
		check(datapath.DriftJump)
		heal()
		nat().Rules[iptables.DefaultChain] = nat().Rules[iptables.DefaultChain][1:]
		check(datapath.DriftChain)
		heal()
		rules := nat().Rules[iptables.DefaultChain]
		rules[0].Text = strings.Replace(rules[0].Text, "RETURN", "ACCEPT", 1)
		check(datapath.DriftChain)
		heal()
		// The whole chain: its jump first, as iptables requires.
		nat().Rules["POSTROUTING"] = nil
		delete(nat().Rules, iptables.DefaultChain)
		nat().Chains = slices.DeleteFunc(nat().Chains, func(c string) bool { return c == iptables.DefaultChain })
		check(datapath.DriftChain, datapath.DriftJump)
		heal()
	}

	// Without the iptables command, the save tool answers.
	for name := range f.Installed {
		if !strings.HasSuffix(name, "-save") && !strings.HasSuffix(name, "-restore") {
			f.Installed[name] = false
		}
	}
	b = newFakeBackend(t, f)
	heal()
	f.NAT(iptables.ModeNFT, policy.IPv4).Rules["POSTROUTING"] = nil
	check(datapath.DriftJump)
	heal()
}
