package bpf

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// TestDifferentialDecide: for random configurations (most with source rules) and random sources
// and destinations, with packets of every protocol the NAT translates (builders: ports, queries,
// address only, IPv6 extension headers), the verdict of the real egress program (masqueraded or
// not, read from the packet) and the rule it counted (read from the per-rule counters) equal
// policy.DecideFrom, and a masqueraded packet leaves from the address of DecideFrom's rule (its
// own, the masqueradeAddress of its lists, which for the global lists the uplink holds as the
// backend writes it, else the uplink's). The configurations are synced one after the other into
// the same datapath, so stale entries of an earlier policy (and of its source rules) would show.
func TestDifferentialDecide(t *testing.T) {
	perFamily := 10000
	if testing.Short() {
		// The kernel matrix's guests (test/kernels) run -short: emulated, the full count takes
		// minutes, and the tries' answers it checks are not what differs between kernels.
		perFamily = 2000
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x6d617371))

	h := newHarness(t, nil, LoadOptions{MaxRules: 1 << 14, NATEntries: 1 << 16})
	probe := 0
	// The round each flow was first probed in: a pod's flow that an earlier round left alone
	// keeps that verdict (keep_v4 and keep_v6 outlive the rounds' NAT resets), so a source rules'
	// pod drawn again with the same flow is replaced by a fresh one.
	type flowKey struct {
		proto    uint8
		pod, dst netip.Addr
		port     uint16
	}
	probed := map[flowKey]int{}
	for round := 0; round < 8; round++ {
		nonMasq := 1 + rng.IntN(40)
		if round == 7 {
			nonMasq = 3000 // a large list, as users raise cidrLimit
		}
		cfg := policytest.WithAddresses(rng, policytest.Config(rng, nonMasq))
		opts := policy.Options{EnableIPv6: round%4 != 3, RandomFully: rng.IntN(2) == 0}
		if round > 0 && round < 7 {
			rules := 8
			if round == 6 {
				rules = 200
			}
			cfg, opts = policytest.WithSourceRules(rng, cfg, rules, opts)
		}
		p := policy.Compile(cfg, opts)
		if err := h.dp.SyncPolicy(p); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		up := Uplink{IPv4: cmp.Or(p.MasqueradeAddress, snat4), IPv6: cmp.Or(p.MasqueradeAddressIPv6, snat6)}
		if _, err := h.dp.SetUplink(testIfindex, up); err != nil {
			t.Fatal(err)
		}
		// Flows from earlier rounds are gone, as after an expiry: every probe is a new flow.
		for _, fam := range policy.Families() {
			if err := h.dp.deleteAllNAT(fam); err != nil {
				t.Fatal(err)
			}
		}
		// The pod that holds each mapping of a protocol without ports (one per remote and
		// masquerade address).
		type heldKey struct {
			proto    uint8
			dst, src netip.Addr
		}
		held := map[heldKey]netip.Addr{}
		slots := h.dp.slotsByRule()
		for _, fam := range policy.Families() {
			want := map[uint32]uint64{}
			before := h.slotPackets()
			for i := 0; i < perFamily; i++ {
				dst := policytest.Destination(rng, p, fam)
				probe++
				// A fresh source per probe (the verdict must come from the tries, not the
				// table), or one aimed at the source rules; never the uplink's own.
				pod := probeSource(fam, probe)
				if len(p.Sources) > 0 && probe%4 != 0 {
					if a := policytest.Source(rng, p, fam); a != up.IPv4 && a != up.IPv6 {
						pod = a
					}
				}
				bs := builders(fam == policy.IPv6)
				b := bs[probe%len(bs)]
				port := uint16(1024 + probe%60000)
				fk := flowKey{b.proto, pod, dst, port}
				if b.kind == pktAddr {
					fk.port = 0
				}
				if r, ok := probed[fk]; ok && r != round {
					pod = probeSource(fam, probe)
				} else if !ok {
					probed[fk] = round
				}
				src, to := b.ends(ap(pod, port), ap(dst, 53))
				in := b.out(src, to)
				ret, out := h.egress(in)
				v := p.DecideFrom(pod, dst)
				wantMasq := v.Action == policy.Masquerade
				if !p.Enabled(fam) {
					wantMasq = false
				}
				wantSrc := up.IPv4
				if fam == policy.IPv6 {
					wantSrc = up.IPv6
				}
				if v.Rule != nil && v.Rule.Address.IsValid() {
					wantSrc = v.Rule.Address
				}
				// A protocol without ports has one mapping per remote and address: another
				// pod's probe to a remote drawn again finds it held by the earlier flow, and
				// is dropped (the same pod's finds its own flow).
				hk := heldKey{b.proto, dst, wantSrc}
				holder, isHeld := held[hk]
				clash := isHeld && holder != pod && wantMasq
				if wantMasq && b.kind == pktAddr && !isHeld {
					held[hk] = pod
				}
				if clash {
					if ret != tcActShot {
						t.Fatalf("round %d %s: %s over %s: verdict %d, want a drop: another flow holds the mapping", round, fam, dst, b.name, int32(ret))
					}
					if v.Rule != nil {
						want[slots[v.Rule]]++
					}
					continue
				}
				if ret != tcNext {
					t.Fatalf("round %d %s: %s over %s: verdict %d", round, fam, dst, b.name, int32(ret))
				}
				got := tupleOf(t, out)
				masqueraded := got.src.Addr() != src.Addr()
				if masqueraded != wantMasq || (!masqueraded && !bytes.Equal(in, out)) || (masqueraded && got.src.Addr() != wantSrc) {
					t.Fatalf("round %d %s: %s -> %s over %s: program masqueraded=%v (packet %s), DecideFrom says %s (%v) from %s",
						round, fam, pod, dst, b.name, masqueraded, got, v.Action, ruleName(v.Rule), wantSrc)
				}
				if v.Rule != nil && p.Enabled(fam) {
					s := slots[v.Rule]
					want[s]++
					if i%97 == 0 {
						// Spot checks that the counted slot is the deciding rule's, probe by probe.
						if n := h.slotPacketsOf(s); n-before[s] != want[s] {
							t.Fatalf("round %d %s: %s: slot of %s counted %d, want %d", round, fam, dst, ruleName(v.Rule), n-before[s], want[s])
						}
					}
				}
			}
			after := h.slotPackets()
			for s := range want {
				if _, ok := after[s]; !ok {
					t.Fatalf("round %d %s: slot %d counted %d packets but holds no rule", round, fam, s, want[s])
				}
			}
			for s, n := range after {
				if d := n - before[s]; d != want[s] {
					k := h.dp.slots.bySlt[s]
					t.Fatalf("round %d %s: slot %d (%s %s %s #%d) counted %d packets, want %d",
						round, fam, s, k.family, k.prefix(), k.action, k.dup, d, want[s])
				}
			}
		}
	}
}

func ruleName(r *policy.Rule) string {
	if r == nil {
		return "no rule"
	}
	return r.Family.String() + " rule " + r.Prefix.String() + " " + r.Action.String() + " " + r.Source()
}

// slotPackets reads the packet counters of every slot in use.
func (h *harness) slotPackets() map[uint32]uint64 {
	h.t.Helper()
	out := map[uint32]uint64{}
	for s := range h.dp.slots.bySlt {
		out[s] = h.slotPacketsOf(s)
	}
	return out
}

func (h *harness) slotPacketsOf(s uint32) uint64 {
	h.t.Helper()
	n, _, err := h.dp.slotStats(s)
	if err != nil {
		h.t.Fatal(err)
	}
	return n
}

// deleteAllNAT empties a family's NAT table.
func (d *Datapath) deleteAllNAT(fam policy.Family) error {
	var all []NATEntry
	if err := d.NATEntries(fam, func(e NATEntry) bool { all = append(all, e); return true }); err != nil {
		return err
	}
	return d.deleteEntries(fam, all)
}

func probeSource(fam policy.Family, n int) netip.Addr {
	if fam == policy.IPv4 {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], 0x0a800000|uint32(n))
		return netip.AddrFrom4(b)
	}
	b := [16]byte{0xfd, 0x42}
	binary.BigEndian.PutUint64(b[8:], uint64(n))
	return netip.AddrFrom16(b)
}
