package bpf

import (
	"maps"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// sourceRulesPolicy compiles a configuration with two source rules toward one destination: pods
// of 10.244.1.0/24 (partner) keep their address there, pods of 10.244.2.0/24 (batch) are
// masqueraded behind an address of their own; other pods go by the global lists.
func sourceRulesPolicy(t *testing.T, partnerNonMasq string) *policy.Policy {
	t.Helper()
	cfg, err := config.Parse([]byte(`
nonMasqueradeCIDRs: [10.0.0.0/8]
masqueradeAddress: 192.0.2.10
sourceRules:
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, `+partnerNonMasq+`]
- name: batch
  cidrs: [10.244.2.0/24]
  masqueradeAddress: 192.0.2.11
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return policy.Compile(cfg, policy.Options{})
}

// TestSourceRules: two sources to one destination get their own rules' verdicts and
// masquerade addresses (and count into their rules' slots), a source no rule holds gets the
// global lists'; a rule change decides new flows and leaves established ones as they were.
func TestSourceRules(t *testing.T) {
	p := sourceRulesPolicy(t, "203.0.113.0/24")
	h := newHarness(t, p, LoadOptions{})
	if _, err := h.dp.SetUplink(testIfindex, Uplink{IPv4: p.MasqueradeAddress}); err != nil {
		t.Fatal(err)
	}
	a := netip.MustParseAddr
	dst := ap(a("203.0.113.7"), 443)
	partner, batch, other := ap(a("10.244.1.5"), 40000), ap(a("10.244.2.5"), 40000), ap(a("10.245.0.5"), 40000)
	send := func(pod netip.AddrPort) netip.Addr {
		t.Helper()
		return tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(pod, dst, tcpSYN, nil))).src.Addr()
	}
	slots := h.dp.slotsByRule()
	before := h.slotPackets()
	for _, c := range []struct {
		pod  netip.AddrPort
		want netip.Addr
	}{{partner, partner.Addr()}, {batch, a("192.0.2.11")}, {other, a("192.0.2.10")}} {
		if got := send(c.pod); got != c.want {
			t.Errorf("%s -> %s leaves from %s, want %s", c.pod, dst, got, c.want)
		}
		v := p.DecideFrom(c.pod.Addr(), dst.Addr())
		if s := slots[v.Rule]; h.slotPacketsOf(s)-before[s] != 1 {
			t.Errorf("%s -> %s: the slot of %s counted %d packets, want 1", c.pod, dst, v.Rule.Source(), h.slotPacketsOf(s)-before[s])
		}
	}

	// partner no longer keeps its address toward the destination: new flows are masqueraded by
	// its outbound rule (the global address); the established one keeps its verdict.
	p2 := sourceRulesPolicy(t, "198.51.100.0/24")
	if err := h.dp.SyncPolicy(p2); err != nil {
		t.Fatal(err)
	}
	if got := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(partner, dst, tcpACK, nil))).src.Addr(); got != partner.Addr() {
		t.Errorf("established %s -> %s leaves from %s after the rule change, want its own address", partner, dst, got)
	}
	if got := send(ap(partner.Addr(), 40001)); got != a("192.0.2.10") {
		t.Errorf("new %s -> %s flow leaves from %s, want 192.0.2.10", partner.Addr(), dst, got)
	}
	// Without source rules, every pod is decided by the global lists, and the rules' entries,
	// settings and ids go.
	p3 := policy.Compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		MasqOutBound: true, MasqueradeAddress: a("192.0.2.10")}, policy.Options{})
	if err := h.dp.SyncPolicy(p3); err != nil {
		t.Fatal(err)
	}
	if got := send(ap(batch.Addr(), 40001)); got != a("192.0.2.10") {
		t.Errorf("new %s -> %s flow leaves from %s after the rules went, want 192.0.2.10", batch.Addr(), dst, got)
	}
	o := &h.dp.objs
	for _, m := range []*ebpf.Map{o.SrcV4, o.SrcV6, o.RmasqV4, o.RnomasqV4, o.RmasqV6, o.RnomasqV6} {
		var k, v []byte
		if m.Iterate().Next(&k, &v) {
			t.Errorf("%s holds entries after the source rules went", m)
		}
	}
	if err := eachEntry(o.SrcCfg, func(id uint32, v *masqSrcRule) {
		if *v != (masqSrcRule{}) {
			t.Errorf("src_cfg[%d] = %+v after the source rules went", id, *v)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if len(h.dp.srcNames) != 0 || len(h.dp.ruleTries) != 0 {
		t.Errorf("source rules left: ids %v, tries of %d ids", h.dp.srcNames, len(h.dp.ruleTries))
	}
}

// TestSourceRulesGrow: rule maps that grow keep each source rule's id and counters, and the
// programs still attached to the smaller maps decide by the old policy while the larger maps
// are synced with a new one (the maps that name rule ids are made anew with the rule tries, so
// the old programs never meet a new rule's id without its lists).
func TestSourceRulesGrow(t *testing.T) {
	p := sourceRulesPolicy(t, "203.0.113.0/24")
	cfg, err := config.Parse([]byte(`
nonMasqueradeCIDRs: [10.0.0.0/8]
masqueradeAddress: 192.0.2.10
sourceRules:
- name: newcomer
  cidrs: [10.244.1.0/25]
  masqueradeCIDRs: [{cidr: 203.0.113.0/24, address: 192.0.2.12}]
  masqueradeAddress: 192.0.2.13
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, 203.0.113.0/24]
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p2 := policy.Compile(cfg, policy.Options{})
	dir := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	h := newHarness(t, p, LoadOptions{MaxRules: 16, PinPath: dir})
	dst := ap(netip.MustParseAddr("203.0.113.7"), 443)
	pod := netip.MustParseAddr("10.244.1.5")
	leaves := func(dp *Datapath, port uint16, want netip.Addr) {
		t.Helper()
		if got := tupleOf(t, h.mustPass(dp.Egress(), tcpPacket(ap(pod, port), dst, tcpSYN, nil))).src.Addr(); got != want {
			t.Errorf("%s -> %s leaves from %s, want %s", pod, dst, got, want)
		}
	}
	leaves(h.dp, 40000, pod)
	small := h.dp
	ids := maps.Clone(small.srcNames)
	bigger, err := small.Grow(PolicyRules(p2) + 100)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bigger.Close() })
	if bigger == small || !maps.Equal(bigger.srcNames, ids) {
		t.Fatalf("grown maps hold source rules %v, want %v", bigger.srcNames, ids)
	}
	if err := bigger.SyncPolicy(p2); err != nil {
		t.Fatal(err)
	}
	leaves(small, 40001, pod) // not yet replaced: the old policy
	leaves(bigger, 40002, netip.MustParseAddr("192.0.2.12"))
	partner := uint32(0)
	for id, name := range ids {
		if name == "partner" {
			partner = id
		}
	}
	if bigger.srcNames[partner] != "partner" {
		t.Errorf("partner lost its id %d across the growth: %v", partner, bigger.srcNames)
	}
	// partner's counters came along: its 203.0.113.0/24 rule counted the first flow.
	h.dp = bigger
	v := p2.DecideFrom(netip.MustParseAddr("10.244.1.200"), dst.Addr())
	if n := h.slotPacketsOf(bigger.slotsByRule()[v.Rule]); n != 1 {
		t.Errorf("%s counted %d packets across the growth, want 1", v.Rule.Source(), n)
	}
}

// TestUpgradeWithoutSourceMaps: an agent of this build started over the pins of the release
// before source rules (the same layout, without their maps) creates the maps beside them, keeps
// every flow and counter, and decides by source rules from its first sync.
func TestUpgradeWithoutSourceMaps(t *testing.T) {
	dir := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	global := policy.Compile(config.Config{NonMasqueradeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		MasqOutBound: true}, policy.Options{})
	h := newHarness(t, global, LoadOptions{PinPath: dir})
	pod, dst := ap(netip.MustParseAddr("10.244.1.5"), 40000), ap(netip.MustParseAddr("203.0.113.7"), 443)
	nat := h.established(pod, dst)
	outbound := h.slotPacketsOf(h.dp.slotsByRule()[&global.IPv4[len(global.IPv4)-1]])
	// The previous release pinned everything but the source rules' maps.
	if err := RemovePins(dir, append(append([]string{masqMapSlotSource}, ruleTrieMaps...), sourceMaps...)...); err != nil {
		t.Fatal(err)
	}
	h.dp.Close()

	dp, err := Load(LoadOptions{PinPath: dir, NATEntries: testNATEntries})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	h.dp = dp
	if missing, err := dp.MissingPins(); err != nil || len(missing) != 0 {
		t.Fatalf("pins missing after the upgrade: %v (%v)", missing, err)
	}
	p := sourceRulesPolicy(t, "203.0.113.0/24")
	if err := dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	// The flow keeps its mapping (and its verdict: partner would now leave it alone).
	if got := tupleOf(t, h.mustPass(dp.Egress(), tcpPacket(pod, dst, tcpACK, nil))).src; got != nat {
		t.Errorf("the established flow leaves as %s after the upgrade, want %s", got, nat)
	}
	if got := tupleOf(t, h.mustPass(dp.Egress(), tcpPacket(ap(pod.Addr(), 40001), dst, tcpSYN, nil))).src.Addr(); got != pod.Addr() {
		t.Errorf("a new flow of the partner rule leaves from %s, want its own address", got)
	}
	// The global outbound rule kept its slot and counters (and counted the flow's packet).
	if n := h.slotPacketsOf(dp.slotsByRule()[&p.IPv4[len(p.IPv4)-1]]); n != outbound+1 {
		t.Errorf("the outbound rule counted %d packets after the upgrade, want %d", n, outbound+1)
	}
}
