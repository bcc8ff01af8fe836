package nftables

import "net/netip"

// trie is a binary trie of the prefixes claimed so far in one phase, for first-match order:
// each prefix gets only what no earlier prefix holds.
type trie struct {
	root node
}

type node struct {
	// full: the whole prefix of the node is claimed (its children are then dropped). A node
	// that is neither full nor has children holds no claim (it was only passed through).
	full     bool
	children [2]*node
}

// claim returns the parts of p that no earlier claim covers, as prefixes in address order,
// and marks all of p claimed. p must be masked.
func (t *trie) claim(p netip.Prefix) []netip.Prefix {
	n := &t.root
	for depth := 0; ; depth++ {
		if n.full {
			return nil
		}
		if depth == p.Bits() {
			break
		}
		b := bit(p.Addr(), depth)
		if n.children[b] == nil {
			n.children[b] = &node{}
		}
		n = n.children[b]
	}
	pieces := free(n, p, nil)
	n.full, n.children = true, [2]*node{}
	return pieces
}

// free appends the parts of p (the prefix of n) that n does not hold.
func free(n *node, p netip.Prefix, out []netip.Prefix) []netip.Prefix {
	switch {
	case n != nil && n.full:
		return out
	case n == nil || n.children == [2]*node{}:
		return append(out, p)
	}
	for b := range 2 {
		out = free(n.children[b], child(p, b), out)
	}
	return out
}

// bit returns bit i of a, counting from the most significant.
func bit(a netip.Addr, i int) int {
	s := a.AsSlice()
	return int(s[i/8]>>(7-i%8)) & 1
}

// child returns the half of p whose next bit is b.
func child(p netip.Prefix, b int) netip.Prefix {
	s := p.Addr().AsSlice()
	i := p.Bits()
	if b == 1 {
		s[i/8] |= 1 << (7 - i%8)
	}
	a, _ := netip.AddrFromSlice(s)
	return netip.PrefixFrom(a, i+1)
}
