package bpf

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
)

// fillLegacyFlows is fillFlows into a table of layout l.
func fillLegacyFlows(b *testing.B, m *ebpf.Map, l, from, n int, lastSeen time.Duration) {
	if l != 1 {
		fillFlowsAs(b, m, from, n, lastSeen, func(e masqNatEntry) masqNatEntry { return e })
		return
	}
	fillFlowsAs(b, m, from, n, lastSeen, func(e masqNatEntry) (v [40]byte) {
		b := unsafe.Slice((*byte)(unsafe.Pointer(&e)), unsafe.Sizeof(e))
		copy(v[:24], b[:24]) // addr, port, kind, flags, slot
		copy(v[32:], b[24:]) // after the ifindex and its padding: last_seen
		return v
	})
}

// BenchmarkMigrate: an upgrade from each older layout over an IPv4 NAT table of 100,000 entries
// (50,000 masqueraded flows), with the maps at the agent's default sizes (262,144 NAT entries per
// family, the rule maps' default slots), as the agent runs it: the first pass (Migrate, reported
// as first-ms), the catch-up right before the programs are swapped (CatchUp, catchup-ms: about
// how long a flow the old programs open then goes unseen by the new ones), and the pass after the
// swap (Finish, finish-ms), which removes the old pins; before each later pass the old programs
// touch 1% of the flows. New maps each time.
func BenchmarkMigrate(b *testing.B) {
	const entries = 100_000
	bpffs := testutil.MountBPFFS(b)
	for _, from := range bpftest.Layouts() {
		if from >= Layout {
			continue
		}
		b.Run(fmt.Sprintf("from=layout%d/entries=%d", from, entries), func(b *testing.B) {
			var first, catchUp, finish time.Duration
			for i := range b.N {
				b.StopTimer()
				root := filepath.Join(bpffs, "b"+strconv.Itoa(from), strconv.Itoa(i))
				old, err := bpftest.Load(from, root, bpftest.Options{NATEntries: DefaultNATEntries, MaxRules: DefaultMaxRules(),
					Uplink: testIfindex, SNAT4: snat4})
				if err != nil {
					b.Fatal(err)
				}
				idle := MonotonicNow() - time.Minute
				fillLegacyFlows(b, old.Map("nat_v4"), from, 0, entries/2, idle)
				pins, err := Inspect(root)
				if err != nil {
					b.Fatal(err)
				}
				dp, err := Load(LoadOptions{PinPath: LayoutDir(root)})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()

				start := time.Now()
				mig, err := dp.Migrate(pins.Sources)
				if err != nil {
					b.Fatal(err)
				}
				first += time.Since(start)

				b.StopTimer()
				if n := mig.Entries[masqMapNatV4]; n != entries {
					b.Fatalf("the first pass carried %d entries, want %d", n, entries)
				}
				fillLegacyFlows(b, old.Map("nat_v4"), from, 0, entries/200, MonotonicNow())
				b.StartTimer()

				start = time.Now()
				if err := mig.CatchUp(dp); err != nil {
					b.Fatal(err)
				}
				catchUp += time.Since(start)

				b.StopTimer()
				if n := mig.Entries[masqMapNatV4]; n < entries+entries/100 {
					b.Fatalf("the catch-up carried %d entries, want the 1%% touched", n-entries)
				}
				fillLegacyFlows(b, old.Map("nat_v4"), from, entries/200, entries/200, MonotonicNow())
				b.StartTimer()

				start = time.Now()
				if err := mig.Finish(dp); err != nil {
					b.Fatal(err)
				}
				finish += time.Since(start)

				b.StopTimer()
				if n := mig.Entries[masqMapNatV4]; n < entries+2*entries/100 {
					b.Fatalf("the passes carried %d entries, want at least %d", n, entries+2*entries/100)
				}
				dp.Close()
				old.Close()
				if err := os.RemoveAll(root); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(first.Milliseconds())/float64(b.N), "first-ms")
			b.ReportMetric(float64(catchUp.Milliseconds())/float64(b.N), "catchup-ms")
			b.ReportMetric(float64(finish.Milliseconds())/float64(b.N), "finish-ms")
		})
	}
}
