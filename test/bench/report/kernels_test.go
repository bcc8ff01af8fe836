package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestKernels: kernels.txt's runs become the per-kernel section, as multiples of each kernel's
// empty program; a run without the file keeps the section of the report as it is.
func TestKernels(t *testing.T) {
	txt := `kernel: 5.10 5.10.0-32-amd64 tcg
goos: linux
BenchmarkEgressEstablished/cidrs=1-2   	    3000	     26340 ns/op	       900.0 ns/pkt
BenchmarkEgressEstablished/cidrs=1-2   	    3000	     26340 ns/op	      1100.0 ns/pkt
BenchmarkEgressEstablished/cidrs=1-2   	    3000	     26340 ns/op	      1000.0 ns/pkt
BenchmarkTestRunFloor-2                	    3000	     25920 ns/op	       100.0 ns/pkt
kernel: host 6.18.44 -
BenchmarkEgressEstablished/cidrs=1-2   	    3000	      2634 ns/op	       400.0 ns/pkt
BenchmarkTestRunFloor-2                	    3000	      2592 ns/op	        80.0 ns/pkt
`
	path := filepath.Join(t.TempDir(), "kernels.txt")
	if err := os.WriteFile(path, []byte(txt), 0o644); err != nil {
		t.Fatal(err)
	}
	runs, err := readKernels(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := spliceKernels([]byte("# Benchmarks\n"), nil, runs)
	for _, want := range []string{"| 5.10 (5.10.0-32-amd64, tcg) | host (6.18.44, -) |",
		"| egress, established flow | 10.0x (9.0-11.0) [1000] | 5.0x (5.0-5.0) [400] |", "| the empty program, ns | 100 | 80 |"} {
		if !bytes.Contains(doc, []byte(want)) {
			t.Errorf("no %q in:\n%s", want, doc)
		}
	}
	kept := spliceKernels([]byte("# Benchmarks, again\n"), doc, nil)
	if !strings.Contains(string(kept), "10.0x (9.0-11.0) [1000]") || strings.Count(string(kept), kernelsBegin) != 1 {
		t.Errorf("the section was not kept:\n%s", kept)
	}
}

// TestKernelsWithoutFloor: a kernel whose empty program was not measured is an error, not a
// section of dashes.
func TestKernelsWithoutFloor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kernels.txt")
	txt := "kernel: 6.1 6.1.0-50-amd64 tcg\nBenchmarkEgressEstablished/cidrs=1-2   3000   26340 ns/op   900.0 ns/pkt\n"
	if err := os.WriteFile(path, []byte(txt), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readKernels(path); err == nil || !strings.Contains(err.Error(), "kernel 6.1 has no BenchmarkTestRunFloor") {
		t.Errorf("readKernels = %v, want an error naming the kernel without its floor", err)
	}
}

// TestKernelsSectionAtEnd: a report that ends with the section's end marker, no newline after it,
// has the section replaced.
func TestKernelsSectionAtEnd(t *testing.T) {
	doc := []byte("# Benchmarks\n\n" + kernelsBegin + "\n\nold\n" + kernelsEnd)
	runs := []kernelRun{{name: "host", release: "6.18", accel: "-", ns: map[string][]float64{floorBench: {80}}}}
	got := string(spliceKernels(doc, nil, runs))
	if strings.Contains(got, "old") || strings.Count(got, kernelsEnd) != 1 || !strings.Contains(got, "| host (6.18, -) |") {
		t.Errorf("spliced:\n%s", got)
	}
}
