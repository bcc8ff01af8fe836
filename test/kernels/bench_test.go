package kernels

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

var benchOut = flag.String("out", "", "BenchmarkKernels: the directory kernels.txt goes to (make bench's results)")

// kernelBenchmarks are pkg/bpf's per-packet benchmarks BenchmarkKernels runs on each kernel: a
// new flow, an established one, a reply, a RETURN, and the empty program, whose cost on the same
// kernel is what the others are read against (under TCG only such ratios mean anything). Two
// patterns, since with "X/Y" a benchmark without sub-benchmarks (the floor) only matches in part
// and is not measured.
var kernelBenchmarks = []string{
	"^Benchmark(EgressEstablished|EgressNewFlow|IngressReverse|EgressReturn)$/^cidrs=1$",
	"^BenchmarkTestRunFloor$",
}

// BenchmarkKernels runs the per-packet benchmarks of pkg/bpf on every kernel of KERNELS, one
// after the other, and writes their output to -out's kernels.txt, each kernel's under a
// "kernel:" line, for test/bench/report. Run it once (-benchtime 1x).
func BenchmarkKernels(b *testing.B) {
	if *benchOut == "" {
		b.Fatal("-out names the directory of the results")
	}
	root, targets, binDir := setUp(b)
	// One command per kernel, so one boot: sh runs the test binary once per pattern.
	var script strings.Builder
	script.WriteString("set -e")
	for _, pattern := range kernelBenchmarks {
		fmt.Fprintf(&script, "; '%s' -test.run='^$' -test.bench='%s' -test.benchtime=3000x -test.count=3",
			filepath.Join(binDir, "bpf.test"), pattern)
	}
	args := []string{"/bin/sh", "-c", script.String()}
	var all strings.Builder
	for range b.N {
		for _, tg := range targets {
			var out strings.Builder
			exitCode, accel, err := tg.run(args, filepath.Join(root, "pkg", "bpf"), nil, 30*time.Minute, &out)
			if err == nil && exitCode != 0 {
				err = fmt.Errorf("exit code %d", exitCode)
			}
			release := hostRelease()
			if tg.img != nil {
				release = tg.img.Release
			}
			if err != nil {
				b.Fatalf("benchmarks on %s: %v\n%s", tg.name, err, testutil.LastLines(out.String(), 40))
			}
			fmt.Fprintf(&all, "kernel: %s %s %s\n%s", tg.name, release, accel, out.String())
		}
	}
	if err := os.WriteFile(filepath.Join(*benchOut, "kernels.txt"), []byte(all.String()), 0o644); err != nil {
		b.Fatal(err)
	}
}

// hostRelease is the host kernel's `uname -r`.
func hostRelease() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}
