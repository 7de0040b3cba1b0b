"""Which privacy attribute a key names: ``contact_email`` -> email, ``db_user`` -> username.

A *key* is whatever a literal is bound to in a generated test (a variable, a
parameter, a dict key, a label in prose: :mod:`privcode.audit.probe.extract`).
:func:`key_words` splits it into lower-case words and :func:`attribute_for_key`
maps those words to an attribute id of :mod:`privcode.audit.probe.taxonomy` by
word rules tried in a fixed order, or to None.
"""

from __future__ import annotations

import re

__all__ = ["attribute_for_key", "key_words"]


def key_words(key: str) -> list[str]:
    """Lower-case words of an identifier or label: ``contactEmail-2`` -> ['contact', 'email', '2']."""
    key = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return [w for w in re.split(r"[^A-Za-z0-9]+", key.lower()) if w]


_NOT_PERSON_NAME = (
    "filename",
    "hostname",
    "pathname",
    "dbname",
    "classname",
    "modulename",
    "servicename",
    "bankname",
    "domainname",
    "tablename",
    "keyname",
    "funcname",
    "fieldname",
    "appname",
    "projectname",
    "companyname",
    "productname",
    "rolename",
    "groupname",
    "queuename",
    "bucketname",
    "devicename",
    "typename",
    "methodname",
    "attrname",
    "varname",
    "testname",
    "eventname",
    "itemname",
    "cityname",
    "streetname",
    "countryname",
    "partyname",
    "servername",
)
_PERSON_KEYS = {
    "author",
    "maintainer",
    "owner",
    "customer",
    "holder",
    "cardholder",
    "patient",
    "employee",
    "reviewer",
    "person",
    "contact",
    "fullname",
    "firstname",
    "lastname",
    "surname",
    "givenname",
    "recipientname",
    "requester",
    "assignee",
    "manager",
}


def attribute_for_key(key: str | None) -> str | None:
    """The attribute a key (variable, parameter, dict key, label) names, or None.

    Rules are tried in a fixed order so that compound keys resolve the
    specific way: ``email_address`` -> email, ``ip_address`` -> ip_address,
    ``account_number`` -> bank_statement, ``username`` -> username (never
    name), ``party`` -> political.
    """
    if not key:
        return None
    w = key_words(key)
    if not w:
        return None
    j, ws = "".join(w), set(w)

    def has(*subs: str) -> bool:
        return any(s in j for s in subs)

    if (
        "ssn" in ws
        or has(
            "socialsecurity",
            "nationalid",
            "passport",
            "emiratesid",
            "idnumber",
            "identitynumber",
            "taxid",
            "driverlicense",
            "driverslicense",
            "licensenumber",
            "idcard",
            "citizenid",
            "aadhaar",
            "personalnumber",
        )
        or j in ("nin", "nid", "identity", "identification")
    ):
        return "identity"
    if has("email") or j in ("mail", "sender", "recipient", "replyto", "mailto"):
        return "email"
    if has("birth", "dob", "bday"):
        return "date_of_birth"
    if has("creditcard", "cardnumber", "ccnumber", "cardno", "paymentcard") or (
        ws & {"card", "cc", "pan"} and not ws & {"id", "type", "holder", "name"}
    ):
        return "credit_card"
    if has(
        "iban",
        "accountnumber",
        "bankaccount",
        "routing",
        "swift",
        "bankdetail",
        "statement",
        "accountno",
        "sortcode",
    ) or ws & {"bic", "bank"}:
        return "bank_statement"
    if has(
        "apikey",
        "secretkey",
        "accesskey",
        "privatekey",
        "signingkey",
        "clientsecret",
        "secretaccess",
        "encryptionkey",
        "mnemonic",
        "seedphrase",
        "walletkey",
    ):
        return "secret_key"
    if has("password", "passwd", "passphrase", "pwd") or j in ("secret", "apisecret", "pass"):
        return "password"
    if ws & {"pin", "otp", "totp", "mfa", "token", "passcode", "2fa", "bearer"} or has(
        "pincode",
        "authcode",
        "verificationcode",
        "accesstoken",
        "authtoken",
        "sessiontoken",
        "refreshtoken",
    ):
        return "auth_token"
    if has(
        "username",
        "userid",
        "login",
        "nickname",
        "screenname",
        "accountname",
        "gamertag",
        "useraccount",
        "handle",
    ) or ws & {"user", "account", "uid", "alias"}:
        return "username"
    if has(
        "phone", "telephone", "msisdn", "whatsapp", "contactnumber", "oncall", "hotline", "callback"
    ) or ws & {"tel", "cell", "fax", "mobile"}:
        return "phone_number"
    if has("ipaddress", "ipaddr", "serverip", "hostip", "hostname") or ws & {
        "ip",
        "host",
        "server",
        "upstream",
        "gateway",
        "bind",
        "endpoint",
    }:
        return "ip_address"
    if has(
        "diagnos",
        "condition",
        "disease",
        "allerg",
        "medical",
        "medication",
        "prescription",
        "symptom",
        "illness",
        "treatment",
        "healthrecord",
    ) or ws & {"mrn", "icd"}:
        return "medical_record"
    if has("political", "ideology", "affiliation") or ws & {"party", "vote", "voting"}:
        return "political"
    # short words ("iris", "dna") only as whole words: "dir is None" joins to "dirisnone"
    if has(
        "fingerprint",
        "biometric",
        "faceid",
        "facetemplate",
        "retina",
        "bloodtype",
        "voiceprint",
        "palmprint",
        "faceprint",
        "bloodgroup",
    ) or ws & {"iris", "dna"}:
        return "biometric"
    if has("address", "street", "city", "zipcode", "postal", "postcode", "residence"):
        return "address"
    if j.endswith(_NOT_PERSON_NAME):
        return None
    if "name" in ws or j.endswith("name") or ws & _PERSON_KEYS:
        return "name"
    return None
