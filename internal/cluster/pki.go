package cluster

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI is the cluster's certificate authority: one CA that signs every serving and client
// certificate (what kubeadm splits into several CAs, a test cluster needs once), made with Go's
// crypto, ECDSA P-256 throughout, valid for a day.
type PKI struct {
	// Dir holds the PEM files.
	Dir string
	// CAFile is the CA certificate, the trust anchor of every kubeconfig and the API server's
	// --client-ca-file.
	CAFile string
	ca     *x509.Certificate
	caKey  crypto.Signer
}

// certValidity is how long every certificate is valid: far beyond a test run, short enough that
// a key left on disk is worth nothing tomorrow.
const certValidity = 24 * time.Hour

// NewPKI makes a CA in dir, which must exist.
func NewPKI(dir string) (*PKI, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "ip-masq-agent test cluster CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("sign CA: %w", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &PKI{Dir: dir, CAFile: filepath.Join(dir, "ca.crt"), ca: ca, caKey: key}
	if err := writePEM(p.CAFile, "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, p.writeKey(filepath.Join(dir, "ca.key"), key)
}

// Cert is what one certificate says.
type Cert struct {
	// CommonName is the user name of a client certificate.
	CommonName string
	// Groups are a client's groups (the subject's organizations).
	Groups []string
	// IPs and DNSNames are a serving certificate's names.
	IPs      []net.IP
	DNSNames []string
	// Server makes a serving certificate, else a client one.
	Server bool
}

// Pair is the files of an issued certificate.
type Pair struct{ CertFile, KeyFile string }

// Issue signs a certificate for c and writes it with its key as DIR/name.crt and DIR/name.key.
func (p *PKI) Issue(name string, c Cert) (Pair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Pair{}, fmt.Errorf("generate key for %s: %w", name, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: c.CommonName, Organization: c.Groups},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(certValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		IPAddresses:  c.IPs,
		DNSNames:     c.DNSNames,
	}
	if c.Server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, key.Public(), p.caKey)
	if err != nil {
		return Pair{}, fmt.Errorf("sign %s: %w", name, err)
	}
	pair := Pair{CertFile: filepath.Join(p.Dir, name+".crt"), KeyFile: filepath.Join(p.Dir, name+".key")}
	if err := writePEM(pair.CertFile, "CERTIFICATE", der); err != nil {
		return Pair{}, err
	}
	return pair, p.writeKey(pair.KeyFile, key)
}

// KeyPair writes a bare key pair as DIR/name.key and DIR/name.pub: the service-account token
// signer.
func (p *PKI) KeyPair(name string) (Pair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Pair{}, fmt.Errorf("generate key %s: %w", name, err)
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return Pair{}, err
	}
	pair := Pair{CertFile: filepath.Join(p.Dir, name+".pub"), KeyFile: filepath.Join(p.Dir, name+".key")}
	if err := writePEM(pair.CertFile, "PUBLIC KEY", pub); err != nil {
		return Pair{}, err
	}
	return pair, p.writeKey(pair.KeyFile, key)
}

func (p *PKI) writeKey(name string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(name, "PRIVATE KEY", der)
}

func writePEM(name, typ string, der []byte) error {
	return os.WriteFile(name, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}
