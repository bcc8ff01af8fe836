package iptables

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestCheckDrift: nothing before the first apply; a deleted or doubled jump is "jump", a
// flushed, changed or deleted chain is "chain", in either family; an apply repairs each; the
// check lists two chains per family and never dumps the table, unless the iptables command is
// missing, where it falls back to the save tool.
func TestCheckDrift(t *testing.T) {
	ctx := context.Background()
	f := newFakeIptables()
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
	before := len(f.calls)
	check()
	for _, c := range f.calls[before:] {
		if strings.HasSuffix(c.name, "-save") || strings.HasSuffix(c.name, "-restore") || !slices.Contains(c.args, "-S") {
			t.Errorf("the check ran %s %q", c.name, c.args)
		}
	}
	if n := len(f.calls) - before; n != 4 {
		t.Errorf("the check ran %d commands, want 4 (two chains, two families)", n)
	}

	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		// A restore replaces the table: look it up afresh each time.
		nat := func() *fakeTable { return f.nat(ModeNFT, fam) }
		nat().rules["POSTROUTING"] = nil
		check(datapath.DriftJump)
		heal()
		nat().rules["POSTROUTING"] = append(nat().rules["POSTROUTING"], nat().rules["POSTROUTING"]...)
		check(datapath.DriftJump)
		heal()
		nat().rules[DefaultChain] = nat().rules[DefaultChain][1:]
		check(datapath.DriftChain)
		heal()
		rules := nat().rules[DefaultChain]
		rules[0].text = strings.Replace(rules[0].text, "RETURN", "ACCEPT", 1)
		check(datapath.DriftChain)
		heal()
		// The whole chain: its jump first, as iptables requires.
		nat().rules["POSTROUTING"] = nil
		delete(nat().rules, DefaultChain)
		nat().chains = slices.DeleteFunc(nat().chains, func(c string) bool { return c == DefaultChain })
		check(datapath.DriftChain, datapath.DriftJump)
		heal()
	}

	// Without the iptables command, the save tool answers.
	for name := range f.installed {
		if !strings.HasSuffix(name, "-save") && !strings.HasSuffix(name, "-restore") {
			f.installed[name] = false
		}
	}
	b = newFakeBackend(t, f)
	heal()
	f.nat(ModeNFT, policy.IPv4).rules["POSTROUTING"] = nil
	check(datapath.DriftJump)
	heal()
}
