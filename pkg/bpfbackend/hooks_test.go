package bpfbackend

import (
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
)

// TestStillBypassed: a hook is bypassed when its device moved packets between two samples while
// our stamp stayed older than the first sample by more than its lag twice; it stops being so
// once our program ran again, and an idle device changes nothing.
func TestStillBypassed(t *testing.T) {
	const s = time.Second
	r := bpf.HookRefresh
	prev := hookSample{at: 10 * s, packets: 100, seen: 9 * s}
	for _, c := range []struct {
		name string
		was  bool
		cur  hookSample
		want bool
	}{
		{"packets, stamp stale", false, hookSample{at: 11 * s, packets: 150, seen: 9 * s}, true},
		{"packets, ours ran after the first sample", false, hookSample{at: 11 * s, packets: 150, seen: 10*s + r}, false},
		// A packet counted after the first sample that passed the hook just before it.
		{"packets, ours ran just before the first sample", false, hookSample{at: 11 * s, packets: 101, seen: 10*s - 2*r}, false},
		{"packets, stamp one lag older than that", false, hookSample{at: 11 * s, packets: 101, seen: 10*s - 2*r - 1}, true},
		{"idle device, was bypassed", true, hookSample{at: 11 * s, packets: 100, seen: 9 * s}, true},
		{"idle device, was not", false, hookSample{at: 11 * s, packets: 100, seen: 9 * s}, false},
		{"ours runs again", true, hookSample{at: 11 * s, packets: 100, seen: 10*s + r}, false},
	} {
		if got := stillBypassed(c.was, prev, c.cur); got != c.want {
			t.Errorf("%s: bypassed %v, want %v", c.name, got, c.want)
		}
	}
}
