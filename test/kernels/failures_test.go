package kernels

import "testing"

// TestFailures: a failure's report is its logged lines and its result, whether go test streamed
// them (-v) or printed them under the result; passing tests' lines are left out.
func TestFailures(t *testing.T) {
	out := `=== RUN   TestA
    a_test.go:1: fine
--- PASS: TestA (0.00s)
=== RUN   TestB
=== RUN   TestB/one
    b_test.go:2: broken
=== RUN   TestB/two
--- FAIL: TestB (0.00s)
    --- FAIL: TestB/one (0.00s)
    --- PASS: TestB/two (0.00s)
=== RUN   TestC
--- FAIL: TestC (0.00s)
    c_test.go:3: late
FAIL
`
	want := `--- FAIL: TestB (0.00s)
    b_test.go:2: broken
    --- FAIL: TestB/one (0.00s)
--- FAIL: TestC (0.00s)
    c_test.go:3: late
`
	if got := parseResults(out).failures(out); got != want {
		t.Errorf("failures:\n%s\nwant:\n%s", got, want)
	}
}

// TestSkipReason: a skipped test's reason is the last line it logged, streamed before its result.
func TestSkipReason(t *testing.T) {
	out := `=== RUN   TestA
    a_test.go:1: setting up
    a_test.go:9: not on this kernel: tcx links
--- SKIP: TestA (0.00s)
=== RUN   TestB
--- PASS: TestB (0.00s)
`
	r := parseResults(out)
	if len(r.skipped) != 1 || r.reason("TestA") != "not on this kernel: tcx links" || len(r.passed) != 1 {
		t.Errorf("skipped %v (%q), passed %v", r.skipped, r.reason("TestA"), r.passed)
	}
}

// TestDemoTable: two demo runs that saw the same addresses compare equal, whatever the ports and
// the padding.
func TestDemoTable(t *testing.T) {
	a := "x\n== what the external host saw, beside\nDESTINATION  TCP SOURCE SEEN\n8.8.8.8      203.0.113.10:33771 (node address)\n\nrest"
	b := "y\n== what the external host saw, beside\nDESTINATION  TCP SOURCE SEEN\n8.8.8.8      203.0.113.10:4242 (node address)\n\nother"
	c := "== what the external host saw, beside\nDESTINATION  TCP SOURCE SEEN\n8.8.8.8      10.244.1.2:4242 (pod address)\n"
	if demoTable(a) != demoTable(b) || demoTable(a) == demoTable(c) || demoTable(a) == "" {
		t.Errorf("tables:\n%s\n%s\n%s", demoTable(a), demoTable(b), demoTable(c))
	}
}

// TestVerifierLine: TestVerifierComplexity's report of each program is found in a log.
func TestVerifierLine(t *testing.T) {
	out := "=== RUN   TestVerifierComplexity\n" +
		"    sync_test.go:412: tc_egress: 99747 instructions processed by the verifier, 3.0x headroom under the guard of 300000\n" +
		"    sync_test.go:412: tc_ingress: 69438 instructions processed by the verifier, 4.3x headroom under the guard of 300000\n"
	m := verifierLine.FindAllStringSubmatch(out, -1)
	if len(m) != 2 || m[0][1] != "tc_egress: 99747 instructions processed by the verifier, 3.0x headroom under the guard of 300000" {
		t.Errorf("found %q", m)
	}
}
