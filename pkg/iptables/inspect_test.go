package iptables_test

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func TestInspect(t *testing.T) {
	ctx := context.Background()
	const doc = "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]"
	p := testPolicy(t, doc, policy.Options{EnableIPv6: true, RandomFully: true})

	f := iptablestest.New()
	if got, err := iptables.Inspect(ctx, f, iptables.DefaultChain, p); err != nil || len(got) != 0 {
		t.Fatalf("nothing installed: %v, %v", got, err)
	}
	// The agent ran where the kernel rejects --random-fully, so its lines lack it.
	f.RejectRandomFully = true
	b := newFakeBackend(t, f)
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	setCounters(f, policy.IPv4, 1)
	setCounters(f, policy.IPv6, 20)
	want, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}

	got, err := iptables.Inspect(ctx, f, iptables.DefaultChain, p)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Mode() != iptables.ModeNFT {
		t.Fatalf("found %d installations, want the nft one", len(got))
	}
	if info := got[0].Info(); info.Backend != iptables.Name || info.AttachMode != datapath.AttachNone ||
		info.Details != "iptables-nft, chain IP-MASQ-AGENT (ipv4, ipv6)" {
		t.Errorf("info %+v", info)
	}
	counters, err := got[0].Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(counters, want) {
		t.Errorf("dump's counters\n got %+v\nwant the agent's %+v", counters, want)
	}

	// A dump given another configuration: the rules it lacks show as lines of no rule, with
	// their destination, action and counters.
	other := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8]", policy.Options{RandomFully: true})
	got, err = iptables.Inspect(ctx, f, iptables.DefaultChain, other)
	if err != nil {
		t.Fatal(err)
	}
	counters, err = got[0].Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var unknown []datapath.RuleCounter
	for _, c := range counters {
		if c.Rule == 0 {
			unknown = append(unknown, c)
			if c.Origin != "" || c.Source() != "?" {
				t.Errorf("unexplained line with an origin: %+v", c)
			}
		}
	}
	wantUnknown := []struct {
		fam     policy.Family
		prefix  string
		action  policy.Action
		packets uint64
	}{
		// IPv4: line 1 (10.10.10.10 masquerade) is not in the other config.
		{policy.IPv4, "10.10.10.10/32", policy.Masquerade, 1},
		// IPv6 is not enabled in the other config: every IPv6 line is unexplained.
		{policy.IPv6, "fe80::/10", policy.Return, 20},
		{policy.IPv6, "fc00::/7", policy.Return, 21},
		{policy.IPv6, "::/0", policy.Masquerade, 22},
	}
	if len(unknown) != len(wantUnknown) {
		t.Fatalf("unexplained lines %+v, want %d", unknown, len(wantUnknown))
	}
	for i, w := range wantUnknown {
		u := unknown[i]
		if u.Family != w.fam || u.Prefix != netip.MustParsePrefix(w.prefix) || u.Action != w.action || u.Packets != w.packets || u.Bytes != 100*w.packets {
			t.Errorf("unexplained #%d = %+v, want %+v", i, u, w)
		}
	}

	// Both modes hold the chain (agents of both modes ran): both are reported, nft first.
	legacy, err := iptables.New(ctx, iptables.Options{Runner: f, Mode: iptables.ModeLegacy})
	if err != nil {
		t.Fatal(err)
	}
	if err := legacy.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	got, err = iptables.Inspect(ctx, f, iptables.DefaultChain, p)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Mode() != iptables.ModeNFT || got[1].Mode() != iptables.ModeLegacy {
		t.Errorf("found %d installations, want nft and legacy", len(got))
	}
}

func TestInspectNamesNoTable(t *testing.T) {
	f := iptablestest.New()
	if _, err := iptables.Inspect(context.Background(), f, iptables.DefaultChain, nil); err != nil {
		t.Fatal(err)
	}
	for _, c := range f.Calls {
		if slices.Contains(c.Args, "-t") {
			t.Errorf("inspect ran %s %q: naming a table loads it", c.Name, c.Args)
		}
	}
	if _, err := iptables.Inspect(context.Background(), f, "bad chain", nil); err == nil {
		t.Error("inspect accepted an invalid chain name")
	}
}
