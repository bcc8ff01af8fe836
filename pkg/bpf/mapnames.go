package bpf

import "github.com/ip-masq-agent/ip-masq-agent/pkg/policy"

// The names of the maps that callers outside this package open by their pins (tests, tools):
// each is the map's name in bpf/maps.h, as bpf2go wrote it, and its pin's name in the layout's
// directory (LayoutDir).
const (
	MapNATv4      = masqMapNatV4
	MapNATv6      = masqMapNatV6
	MapUplinkSNAT = masqMapUplinkSnat
)

// TrieMaps are the names of a family's rule tries: the masquerade one, looked up first, and the
// non-masquerade one.
func TrieMaps(fam policy.Family) (masq, nomasq string) {
	if fam == policy.IPv6 {
		return masqMapMasqV6, masqMapNomasqV6
	}
	return masqMapMasqV4, masqMapNomasqV4
}

// SourceTrie is the name of a family's source trie: the sources of the source rules
// (policy.Policy.SourceTable), each naming the rule that decides it.
func SourceTrie(fam policy.Family) string {
	if fam == policy.IPv6 {
		return masqMapSrcV6
	}
	return masqMapSrcV4
}
