package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
)

// TestSectionsKeptOrRewrittenWhole: a big-node section is rewritten from all of its results, or
// kept as the report has it when a run has some of them (with a note) or none; the other
// sections stay as they are.
func TestSectionsKeptOrRewrittenWhole(t *testing.T) {
	old := []byte(bigBegin + "\n\n" +
		sectionBegin("live") + "\n\nold live section\n\n" + sectionEnd("live") + "\n\n" +
		sectionBegin("parallel") + "\n\nold parallel section\n\n" + sectionEnd("parallel") + "\n\n" + bigEnd + "\n")
	live := []benchdata.LiveCIDRs{{Mode: "bpf", CIDRs: 100_000, Changed: 10, Verdict: []float64{0.05}, Applied: []float64{0.06}}}
	syncs := map[string][]map[string]float64{"BenchmarkTrieWrite": {{"put-ms": 45, "delete-ms": 24}}}

	var b bytes.Buffer
	notes := writeBigNode(&b, &bigNode{live: live}, old)
	if got := b.String(); !strings.Contains(got, "old live section") || !strings.Contains(got, "old parallel section") {
		t.Fatalf("live results without synctries.txt: want both sections kept, got\n%s", got)
	}
	if len(notes) != 1 || !strings.Contains(notes[0], "synctries.txt") {
		t.Fatalf("notes %q, want one naming synctries.txt", notes)
	}

	b.Reset()
	notes = writeBigNode(&b, &bigNode{live: live, syncs: syncs}, old)
	got := b.String()
	if strings.Contains(got, "old live section") || !strings.Contains(got, "10 of 100k changed") || !strings.Contains(got, "the kernel's part") {
		t.Fatalf("all of live's results: want the section rewritten with both parts, got\n%s", got)
	}
	if !strings.Contains(got, "old parallel section") || len(notes) != 0 {
		t.Fatalf("want the parallel section kept and no notes (%q), got\n%s", notes, got)
	}
	if strings.Count(got, sectionBegin("live")) != 1 || strings.Count(got, sectionEnd("live")) != 1 {
		t.Fatalf("want one live section, got\n%s", got)
	}

	// A new report: a section with some of its results is written from them.
	b.Reset()
	writeBigNode(&b, &bigNode{live: live}, nil)
	if !strings.Contains(b.String(), "10 of 100k changed") {
		t.Fatalf("no report yet: want the live section from the results there are, got\n%s", b.String())
	}
}
