package bpf

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// changedPolicy is benchPolicy(n) with its last k non-masquerade CIDRs replaced by others
// (prefixes of 127.0.0.0/8's neighbour 128.0.0.0/8, which benchPolicy never draws), the i-th
// such change of the same base: the swap a ConfigMap edit makes.
func changedPolicy(n, k, i int) *policy.Policy {
	base := benchPolicy(n)
	var cidrs []netip.Prefix
	for _, r := range base.IPv4 {
		if r.Origin == policy.OriginNonMasqueradeCIDRs {
			cidrs = append(cidrs, r.Prefix)
		}
	}
	for j := range k {
		cidrs[len(cidrs)-1-j] = netip.PrefixFrom(netip.AddrFrom4([4]byte{128, byte(i), byte(j), 0}), 24)
	}
	cfg := config.Config{NonMasqueradeCIDRs: cidrs, MasqOutBound: true, MasqOutBoundIPv6: true}
	return policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
}

// BenchmarkSyncPolicyChange: a policy of 100k CIDRs of which a sync changes 10 (the realistic
// ConfigMap edit; BenchmarkSyncPolicyReplace replaces all of them).
func BenchmarkSyncPolicyChange(b *testing.B) {
	const n, k = 100_000, 10
	h := newHarness(b, changedPolicy(n, k, 0), LoadOptions{MaxRules: CapacityFor(n + k), NATEntries: 1 << 10})
	p := [2]*policy.Policy{changedPolicy(n, k, 0), changedPolicy(n, k, 1)}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := h.dp.SyncPolicy(p[(i+1)%2]); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkTrieWrite is the kernel's part of a whole-set swap, the floor under
// BenchmarkSyncPolicyReplace: n /24s written in batches into the IPv4 RETURN trie beside the n
// others it holds, then those others deleted in batches, as SyncPolicy writes and deletes them
// (keys and values built beforehand). put-ms and delete-ms are the two halves.
func BenchmarkTrieWrite(b *testing.B) {
	const n = 100_000
	// Room for both sets at once, as SyncPolicyReplace has.
	h := newHarness(b, benchPolicy(1), LoadOptions{MaxRules: CapacityFor(2 * n), NATEntries: 1 << 10})
	m := h.dp.objs.NomasqV4
	var sets [2][]masqLpm4Key
	for s := range sets {
		for i := range n {
			j := s*n + i
			sets[s] = append(sets[s], masqLpm4Key{Prefixlen: 24, Addr: [4]byte{byte(11 + j/65536), byte(j / 256), byte(j), 0}})
		}
	}
	vals := make([]masqLpm4Val, n)
	for i := range vals {
		vals[i] = masqLpm4Val{Action: masqActionACTION_RETURN, Slot: uint32(i)}
	}
	if err := putAll(m, sets[0], vals); err != nil {
		b.Fatal(err)
	}
	var put, del time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		in, out := sets[(i+1)%2], sets[i%2]
		start := time.Now()
		if err := putAll(m, in, vals); err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		if _, err := m.BatchDelete(out, nil); err != nil {
			b.Fatal(fmt.Errorf("delete: %w", err))
		}
		put, del = put+mid.Sub(start), del+time.Since(mid)
	}
	b.ReportMetric(float64(put.Milliseconds())/float64(b.N), "put-ms")
	b.ReportMetric(float64(del.Milliseconds())/float64(b.N), "delete-ms")
}
