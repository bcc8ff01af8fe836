package bpfbackend

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
)

func TestParseTimeouts(t *testing.T) {
	got, err := parseTimeouts(" udp=30s, tcp-closing=1.5s,")
	if err != nil {
		t.Fatal(err)
	}
	// Only what it sets: the rest is left to the node's conntrack sysctls.
	want := bpf.Timeouts{UDP: 30 * time.Second, TCPClosing: 1500 * time.Millisecond}
	if got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if got, err := parseTimeouts(""); err != nil || got != (bpf.Timeouts{}) {
		t.Errorf("empty: %+v %v, want none set", got, err)
	}
}

// The flags' defaults are valid, and Check keeps each flag within its bounds.
func TestSettingsCheck(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{nil, ""},
		{[]string{"--nat-timeouts=udp=30s"}, ""},
		{[]string{"--attach-mode=xdp"}, `attach mode "xdp": must be auto, tcx or tc`},
		{[]string{"--nat-sweep-interval=0s"}, "nat-sweep-interval 0s: must be positive"},
		{[]string{"--nat-max-entries=1023"}, "nat-max-entries 1023: must be from 1024 to 16777216"},
		{[]string{"--nat-timeouts=tcp=1m"}, `"tcp=1m": want KEY=DURATION`},
	} {
		fs := flag.NewFlagSet("", flag.ContinueOnError)
		s := registerFlags(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		err := s.Check()
		if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("%q: %v, want %q", tc.args, err, tc.wantErr)
		}
		if tc.wantErr == "" && tc.args != nil && s.Timeouts.UDP != 30*time.Second {
			t.Errorf("%q: timeouts %+v", tc.args, s.Timeouts)
		}
	}
}
