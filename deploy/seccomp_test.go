package deploy

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"reflect"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// The shipped seccomp profile is containers-common's default (what CRI-O and podman apply as
// RuntimeDefault) with bpf(2) allowed under CAP_BPF and perf_event_open(2) under CAP_PERFMON, as
// containerd's and Docker's defaults allow them. test/container runs the agent under it.
const (
	seccompProfile = "seccomp/ip-masq-agent.json"
	// containersCommon is where Debian's golang-github-containers-common (podman's dependency)
	// installs the default profile.
	containersCommon = "/usr/share/containers/seccomp.json"
)

var updateSeccomp = flag.Bool("update-seccomp", false, "write "+seccompProfile+" from "+containersCommon)

// rule is one entry of a profile's syscalls, the fields this test reads.
type rule struct {
	Names    []string `json:"names"`
	Action   string   `json:"action"`
	Includes struct {
		Caps []string `json:"caps"`
	} `json:"includes"`
	Excludes struct {
		Caps []string `json:"caps"`
	} `json:"excludes"`
	Args []any `json:"args"`
}

// allowedWith reports whether a profile allows syscall to a process holding exactly caps, as
// the runtimes read includes and excludes (a rule applies when the process holds every
// included capability and none of the excluded ones; the first rule that names the syscall
// without arguments decides).
func allowedWith(t *testing.T, rules []rule, syscall string, caps ...string) bool {
	t.Helper()
	for _, r := range rules {
		if !slices.Contains(r.Names, syscall) || len(r.Args) > 0 {
			continue
		}
		applies := true
		for _, c := range r.Includes.Caps {
			applies = applies && slices.Contains(caps, c)
		}
		for _, c := range r.Excludes.Caps {
			applies = applies && !slices.Contains(caps, c)
		}
		if applies {
			return r.Action == "SCMP_ACT_ALLOW"
		}
	}
	return false
}

// withBPF is containers-common's profile with bpf(2) and perf_event_open(2) under their own
// capabilities: both leave the rule that refuses them without CAP_SYS_ADMIN, and each gets a
// rule allowing it with its capability and one refusing it (EPERM) without either.
func withBPF(t *testing.T, base []byte) []byte {
	t.Helper()
	var p map[string]any
	if err := json.Unmarshal(base, &p); err != nil {
		t.Fatal(err)
	}
	moved := []string{"bpf", "perf_event_open"}
	var out []any
	found := false
	for _, r := range p["syscalls"].([]any) {
		m := r.(map[string]any)
		names := m["names"].([]any)
		if m["action"] == "SCMP_ACT_ERRNO" && slices.Contains(names, any("bpf")) {
			found = true
			m["names"] = slices.DeleteFunc(slices.Clone(names), func(n any) bool { return slices.Contains(moved, n.(string)) })
			out = append(out, m)
			for _, g := range []struct{ name, cap string }{{"bpf", "CAP_BPF"}, {"perf_event_open", "CAP_PERFMON"}} {
				out = append(out,
					map[string]any{"names": []any{g.name}, "action": "SCMP_ACT_ALLOW", "args": []any{}, "comment": "",
						"includes": map[string]any{"caps": []any{g.cap}}, "excludes": map[string]any{}},
					map[string]any{"names": []any{g.name}, "action": "SCMP_ACT_ERRNO", "args": []any{}, "comment": "",
						"includes": map[string]any{}, "excludes": map[string]any{"caps": []any{"CAP_SYS_ADMIN", g.cap}},
						"errnoRet": float64(1), "errno": "EPERM"})
			}
			continue
		}
		out = append(out, m)
	}
	if !found {
		t.Fatalf("%s has no rule refusing bpf: its layout changed", containersCommon)
	}
	p["syscalls"] = out
	data, err := json.MarshalIndent(p, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return append(data, '\n')
}

func TestSeccompProfile(t *testing.T) {
	shipped, err := os.ReadFile(seccompProfile)
	if err != nil {
		t.Fatal(err)
	}
	var p struct {
		DefaultAction string `json:"defaultAction"`
		Syscalls      []rule `json:"syscalls"`
	}
	if err := json.Unmarshal(shipped, &p); err != nil {
		t.Fatal(err)
	}
	if p.DefaultAction != "SCMP_ACT_ERRNO" {
		t.Errorf("default action %s: the profile must refuse what it does not list", p.DefaultAction)
	}
	// What the agent needs, with the DaemonSet's capabilities; and not without them.
	caps := []string{"CAP_NET_ADMIN", "CAP_BPF", "CAP_PERFMON", "CAP_NET_RAW"}
	for _, c := range []struct {
		syscall string
		caps    []string
		want    bool
	}{
		{"bpf", caps, true},
		{"perf_event_open", caps, true},
		{"bpf", []string{"CAP_NET_ADMIN"}, false},
		{"perf_event_open", []string{"CAP_BPF"}, false},
		{"bpf", []string{"CAP_SYS_ADMIN"}, true},
		{"sethostname", caps, false}, // still only with CAP_SYS_ADMIN, as in containers-common
		{"setsockopt", caps, true},
		{"kexec_load", append(caps, "CAP_SYS_ADMIN"), false},
	} {
		if got := allowedWith(t, p.Syscalls, c.syscall, c.caps...); got != c.want {
			t.Errorf("%s with %v: allowed %v, want %v", c.syscall, c.caps, got, c.want)
		}
	}

	base, err := os.ReadFile(containersCommon)
	if err != nil {
		testutil.Unavailable(t, "the profile is derived from containers-common's (apt-get install golang-github-containers-common): %v", err)
	}
	want := withBPF(t, base)
	if *updateSeccomp {
		if err := os.WriteFile(seccompProfile, want, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	var got, wantProfile any
	if err := json.Unmarshal(shipped, &got); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(want, &wantProfile); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, wantProfile) {
		t.Errorf("%s is not %s with bpf(2) and perf_event_open(2) allowed under their capabilities: go test ./deploy -run TestSeccompProfile -update-seccomp rewrites it", seccompProfile, containersCommon)
	}
	if bytes.Equal(shipped, base) {
		t.Error("the profile is containers-common's unchanged")
	}
}
