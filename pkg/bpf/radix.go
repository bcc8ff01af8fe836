package bpf

import (
	"cmp"
	"encoding/binary"
	"net/netip"
	"slices"
)

// sortPlanned sorts entries (in policy order) into prefixOrder, entries of one prefix by rule.
// IPv4 entries sort as numbers (address, length, rule), several times faster than by comparing
// netip.Prefix.
func sortPlanned(entries []planned) {
	const idxBits = 26 // room for the rules' indexes: MaxRules is far below 1<<26
	if len(entries) == 0 || !entries[0].prefix.Addr().Is4() || entries[len(entries)-1].idx >= 1<<idxBits {
		slices.SortFunc(entries, func(a, b planned) int { return cmp.Or(prefixOrder(a.prefix, b.prefix), a.idx-b.idx) })
		return
	}
	packed := make([]uint64, len(entries))
	inOrder := true // by rule, as a plan gathers them
	for i, e := range entries {
		a := e.prefix.Addr().As4()
		packed[i] = (uint64(binary.BigEndian.Uint32(a[:]))<<6|uint64(e.prefix.Bits()))<<idxBits | uint64(e.idx)
		inOrder = inOrder && (i == 0 || e.idx > entries[i-1].idx)
	}
	// Entries in rule order need a stable sort on the prefix bits alone, which leaves the rules
	// of one prefix in that order; else the rule bits are sorted too.
	var shift uint
	if inOrder {
		shift = idxBits
	}
	sortStableAbove(packed, shift)
	for i, k := range packed {
		var a [4]byte
		binary.BigEndian.PutUint32(a[:], uint32(k>>(6+idxBits)))
		entries[i] = planned{netip.PrefixFrom(netip.AddrFrom4(a), int(k>>idxBits&63)), int(k & (1<<idxBits - 1))}
	}
}

// sortStableAbove sorts keys by their bits from shift up, keys with the same such bits in the
// order they come: a least-significant-digit radix sort, a few passes over 100k keys where a
// comparison sort takes several times as long. A pass whose digit is the same in every key (the
// prefix lengths of a list of /24s, the first octet of one network's addresses) is skipped.
func sortStableAbove(keys []uint64, shift uint) {
	const digitBits = 11
	if len(keys) < 2 {
		return
	}
	var (
		count [1 << digitBits]int
		buf   []uint64
		orig  = keys
	)
	for ; shift < 64; shift += digitBits {
		clear(count[:])
		for _, k := range keys {
			count[k>>shift&(1<<digitBits-1)]++
		}
		if count[keys[0]>>shift&(1<<digitBits-1)] == len(keys) {
			continue
		}
		pos := 0
		for d, c := range count {
			count[d], pos = pos, pos+c
		}
		if buf == nil {
			buf = make([]uint64, len(keys))
		}
		for _, k := range keys {
			d := k >> shift & (1<<digitBits - 1)
			buf[count[d]] = k
			count[d]++
		}
		keys, buf = buf, keys
	}
	if &keys[0] != &orig[0] {
		copy(orig, keys)
	}
}
