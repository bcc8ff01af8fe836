package policy

import (
	"fmt"
	"strconv"
	"strings"
)

// PortRange is an inclusive range of source ports for masqueraded flows.
type PortRange struct {
	First, Last uint16
}

// Size is the number of ports in the range.
func (r PortRange) Size() int { return int(r.Last) - int(r.First) + 1 }

func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// PortRanges is the value of --to-ports: ranges in the order given.
type PortRanges []PortRange

// DefaultPortRange is what the BPF datapath uses when --to-ports is empty: the upper half,
// which leaves the ports below to host services (and matches Linux's default ephemeral range).
var DefaultPortRange = PortRange{First: 32768, Last: 65535}

// Size is the number of ports in all ranges.
func (rs PortRanges) Size() int {
	n := 0
	for _, r := range rs {
		n += r.Size()
	}
	return n
}

func (rs PortRanges) String() string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.String()
	}
	return strings.Join(parts, ",")
}

// ParsePortRanges parses "1024-29999,32768-65535" (upstream --to-ports syntax). An empty string
// gives no ranges. Ranges must be within 1-65535, each first <= last, and must not overlap.
func ParsePortRanges(s string) (PortRanges, error) {
	if s == "" {
		return nil, nil
	}
	var rs PortRanges
	for _, part := range strings.Split(s, ",") {
		first, last, isRange := strings.Cut(part, "-")
		f, err := parsePort(first)
		if err != nil {
			return nil, fmt.Errorf("to-ports %q: %w", s, err)
		}
		l := f
		if isRange {
			if l, err = parsePort(last); err != nil {
				return nil, fmt.Errorf("to-ports %q: %w", s, err)
			}
		}
		if f > l {
			return nil, fmt.Errorf("to-ports %q: range %q starts after it ends", s, part)
		}
		r := PortRange{First: f, Last: l}
		for _, o := range rs {
			if r.First <= o.Last && o.First <= r.Last {
				return nil, fmt.Errorf("to-ports %q: ranges %s and %s overlap", s, o, r)
			}
		}
		rs = append(rs, r)
	}
	return rs, nil
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("%q is not a port between 1 and 65535", s)
	}
	return uint16(n), nil
}
