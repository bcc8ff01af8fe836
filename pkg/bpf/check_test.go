package bpf

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestCheckPolicy: a trie entry deleted, added or changed, and nat_config changed behind the
// datapath's back are each reported by name; Refresh and a sync repair them and the check is
// clean again.
func TestCheckPolicy(t *testing.T) {
	p := defaultPolicy(true)
	h := newHarness(t, p, LoadOptions{})
	check := func(want ...string) {
		t.Helper()
		got, err := h.dp.checkedMaps()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("CheckPolicy = %v, want %v", got, want)
		}
	}
	repair := func() {
		t.Helper()
		if err := h.dp.Refresh(); err != nil {
			t.Fatal(err)
		}
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatal(err)
		}
		check()
	}
	check()

	tenSlash8 := netip.MustParsePrefix("10.0.0.0/8")
	if err := h.dp.objs.NomasqV4.Delete(lpmKey(tenSlash8)); err != nil {
		t.Fatal(err)
	}
	check(masqMapNomasqV4)
	repair()

	// An entry added.
	if err := h.dp.objs.MasqV6.Put(lpmKey(netip.MustParsePrefix("2001:db8::/32")), &masqLpm6Val{Slot: 1, Action: masqActionACTION_MASQUERADE}); err != nil {
		t.Fatal(err)
	}
	check(masqMapMasqV6)
	repair()

	// An entry's slot changed, and nat_config's outbound rule.
	if err := h.dp.objs.NomasqV4.Put(lpmKey(tenSlash8), &masqLpm4Val{Slot: 4000}); err != nil {
		t.Fatal(err)
	}
	var cfg masqNatConfig
	if err := h.dp.objs.NatConfig.Lookup(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.V4.Outbound = masqActionACTION_RETURN
	if err := h.dp.objs.NatConfig.Put(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	check(masqMapNomasqV4, masqMapNatConfig)
	repair()

	// A masquerade entry's address changed, its slot and action as written; the repair writes
	// the rule's address back.
	p = withAddrs(prefixes("198.51.100.0/24"), nil, true, map[string]string{"198.51.100.0/24": "192.0.2.11"})
	if err := h.dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	check()
	key := lpmKey(netip.MustParsePrefix("198.51.100.0/24"))
	var v masqLpm4Val
	if err := h.dp.objs.MasqV4.Lookup(key, &v); err != nil {
		t.Fatal(err)
	}
	v.Snat = netip.MustParseAddr("192.0.2.12").As4()
	if err := h.dp.objs.MasqV4.Put(key, &v); err != nil {
		t.Fatal(err)
	}
	check(masqMapMasqV4)
	repair()
	if err := h.dp.objs.MasqV4.Lookup(key, &v); err != nil {
		t.Fatal(err)
	}
	if got := netip.AddrFrom4(v.Snat); got != netip.MustParseAddr("192.0.2.11") {
		t.Errorf("repaired entry masquerades to %s, want 192.0.2.11", got)
	}
}

// checkedMaps is CheckPolicy as the names of the maps it found changed.
func (d *Datapath) checkedMaps() ([]string, error) {
	drift, err := d.CheckPolicy()
	if drift.NATConfig {
		drift.Tries = append(drift.Tries, masqMapNatConfig)
	}
	return drift.Tries, err
}

// TestCheckPolicyInTurns: in a trie larger than one call's lookups, a deleted entry is still
// found within the calls that cover every entry.
func TestCheckPolicyInTurns(t *testing.T) {
	const n = 3*checkBudget + 17
	p := benchPolicy(n)
	h := newHarness(t, p, LoadOptions{MaxRules: 2 * n})
	victim := p.IPv4[n/2].Prefix
	if err := h.dp.objs.NomasqV4.Delete(lpmKey(victim)); err != nil {
		t.Fatal(err)
	}
	entries := 0
	for _, tr := range h.dp.tries {
		entries += len(tr.held)
	}
	calls := entries/checkBudget + 1
	found := 0
	for i := range calls {
		got, err := h.dp.checkedMaps()
		if err != nil {
			t.Fatal(err)
		}
		if slices.Equal(got, []string{masqMapNomasqV4}) {
			found = i + 1
			break
		}
		if len(got) != 0 {
			t.Fatalf("call %d: %v", i+1, got)
		}
	}
	if found == 0 {
		t.Fatalf("%s deleted from a trie of %d entries: not found in %d calls", victim, entries, calls)
	}
	t.Logf("found in call %d of at most %d", found, calls)
}

// TestTrieWalkByKey: the walk for kernels without batch lookups reads the same entries as the
// batched one, at most as many as asked each time.
func TestTrieWalkByKey(t *testing.T) {
	h := newHarness(t, benchPolicy(300), LoadOptions{MaxRules: 1024})
	read := func(w trieWalk, max int) []trieEntry {
		t.Helper()
		var all []trieEntry
		for done := false; !done; {
			var got []trieEntry
			var err error
			if got, done, err = w.next(max); err != nil {
				t.Fatal(err)
			}
			if len(got) > max {
				t.Fatalf("%d entries asking for %d", len(got), max)
			}
			all = append(all, got...)
		}
		return all
	}
	batched := read(lpmOps[masqLpm4Key, masqLpm4Val]{}.walk(h.dp.objs.NomasqV4), 64)
	byKey := read(&lpmWalk[masqLpm4Key, masqLpm4Val]{mapReader: keyByKey(h.dp.objs.NomasqV4)}, 64)
	if len(batched) != len(h.dp.tries[1].held) || !slices.Equal(batched, byKey) {
		t.Fatalf("batched walk %d entries, by key %d, the sync wrote %d", len(batched), len(byKey), len(h.dp.tries[1].held))
	}
	for _, e := range byKey {
		if want, ok := h.dp.tries[1].held[e.prefix]; !ok || want != e.trieValue {
			t.Fatalf("walk read %s %+v, the sync wrote %+v (%v)", e.prefix, e.trieValue, want, ok)
		}
	}
}

// TestRepin: a map pin removed is reported and pinned again; a datapath loaded over the pins
// afterwards finds the same maps (the flows survive).
func TestRepin(t *testing.T) {
	dir := filepath.Join(testutil.MountBPFFS(t), "ip-masq-agent")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	opts := LoadOptions{PinPath: dir, NATEntries: 1 << 12, NATEntriesV6: 1 << 6}
	dp, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	if missing, err := dp.MissingPins(); err != nil || len(missing) != 0 {
		t.Fatalf("right after Load: %v %v", missing, err)
	}
	if err := dp.SyncPolicy(defaultPolicy(true)); err != nil {
		t.Fatal(err)
	}
	if _, err := dp.SetUplink(testIfindex, Uplink{IPv4: snat4}); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, dp: dp}
	h.mustPass(dp.Egress(), udpPacket(ap(pod4(1), 1000), ap(remote4, 53), nil))
	for _, name := range []string{"nat_v4", "uplink_snat"} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if missing, err := dp.MissingPins(); err != nil || !slices.Equal(missing, []string{"nat_v4", "uplink_snat"}) {
		t.Fatalf("after removing two pins: %v %v", missing, err)
	}
	if got, err := dp.Repin(); err != nil || !slices.Equal(got, []string{"nat_v4", "uplink_snat"}) {
		t.Fatalf("Repin: %v %v", got, err)
	}
	if missing, err := dp.MissingPins(); err != nil || len(missing) != 0 {
		t.Fatalf("after Repin: %v %v", missing, err)
	}
	next, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	flows := 0
	if err := next.NATEntries(policy.IPv4, func(NATEntry) bool { flows++; return true }); err != nil {
		t.Fatal(err)
	}
	if flows != 2 {
		t.Errorf("a datapath loaded over the repinned maps holds %d NAT entries, want the flow's 2", flows)
	}
	if u, ok, err := next.Uplink(testIfindex); err != nil || !ok || u.IPv4 != snat4 {
		t.Errorf("uplink after Repin: %+v %v %v", u, ok, err)
	}
}

// BenchmarkCheckPolicy is the BPF backend's per-second drift check of the tries, by policy
// size: checkBudget entries walked at most, whatever the size.
func BenchmarkCheckPolicy(b *testing.B) {
	for _, n := range []int{64, 10_000, 100_000} {
		b.Run(policyName(n), func(b *testing.B) {
			h := newHarness(b, benchPolicy(n), LoadOptions{MaxRules: 1 << 17})
			if _, err := h.dp.CheckPolicy(); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				got, err := h.dp.checkedMaps()
				if err != nil || len(got) != 0 {
					b.Fatalf("%v %v", got, err)
				}
			}
		})
	}
}

func policyName(n int) string {
	return fmt.Sprintf("cidrs=%d", n)
}
