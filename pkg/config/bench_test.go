package config

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkParseCIDRs: Parse of a ConfigMap of 100k non-masquerade CIDRs (1.9 MB), the file a
// 100k swap reads.
func BenchmarkParseCIDRs(b *testing.B) {
	const n = 100_000
	var sb strings.Builder
	fmt.Fprintf(&sb, "cidrLimit: %d\nnonMasqueradeCIDRs:\n", n)
	for i := range n {
		fmt.Fprintf(&sb, "  - %d.%d.%d.0/24\n", 11+i/65536, (i/256)%256, i%256)
	}
	data := []byte(sb.String())
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		cfg, err := Parse(data, Options{})
		if err != nil || len(cfg.NonMasqueradeCIDRs) != n {
			b.Fatal(len(cfg.NonMasqueradeCIDRs), err)
		}
	}
}
